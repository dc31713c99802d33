"""The command-line interface: one module per subcommand, one error boundary."""
