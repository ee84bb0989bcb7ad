"""Write a random-weight Llama folder with a real checkpoint's config, as transformers writes it.

Nothing can be downloaded here, so the README's fine-tuning example and tests/unit/test_pretrained.py start
from folders like this one: transformers' LlamaForCausalLM.save_pretrained with the published config.json
values of SmolLM2-135M, TinyLlama-1.1B or Llama-3.2-1B, reduced in depth, width and vocabulary so it stays
tiny, with every field that changes the numbers kept at its real value (rope_theta, rope_scaling, the head
size and the query/key-value head ratio, tie_word_embeddings, rms_norm_eps, max_position_embeddings), and a
small BPE tokenizer with the checkpoint's special tokens (BOS added where the real tokenizer adds one).
A real folder (`huggingface-cli download HuggingFaceTB/SmolLM2-135M`) works with `--init-from` the same way.

    .venv/bin/python benchmarks/pretrained_folder.py llama-3.2-1b runs/llama32-tiny
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

# The published config.json values (the fields that change the numbers), typed in from the model cards' files.
REAL_CONFIGS = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, rope_scaling=None, tie_word_embeddings=True,
                         attention_bias=False, mlp_bias=False, hidden_act="silu"),
    "tinyllama-1.1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                           num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                           rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=False,
                           attention_bias=False, mlp_bias=False, hidden_act="silu"),
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                         tie_word_embeddings=True, attention_bias=False, mlp_bias=False, hidden_act="silu"),
}
# (BOS, EOS, whether the tokenizer puts BOS before a text) of each checkpoint's tokenizer.
SPECIAL_TOKENS = {
    "smollm2-135m": ("<|endoftext|>", "<|endoftext|>", False),
    "tinyllama-1.1b": ("<s>", "</s>", True),
    "llama-3.2-1b": ("<|begin_of_text|>", "<|end_of_text|>", True),
}


def reduced(name: str, *, heads_per_kv: int | None = None, kv_heads: int = 1, layers: int = 2,
            vocab_size: int = 512, **changes) -> dict:
    """The real config at a small size: the head size (64 in all three) and the query/key-value head ratio
    stay real, the width follows from them, the MLP keeps its ratio to the width."""
    real = dict(REAL_CONFIGS[name])
    head_dim = real.get("head_dim") or real["hidden_size"] // real["num_attention_heads"]
    ratio = heads_per_kv or real["num_attention_heads"] // real["num_key_value_heads"]
    heads = ratio * kv_heads
    hidden = heads * head_dim
    ffn = round(real["intermediate_size"] / real["hidden_size"] * hidden / 16) * 16
    real.update(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads)
    if "head_dim" in real:
        real["head_dim"] = head_dim
    real.update(changes)
    return real


def write_folder(directory: Path, name: str, config: dict | None = None, *, seed: int = 0,
                 qk_gain: float = 1.0, tokenizer: bool = True) -> Path:
    """save_pretrained of a random LlamaForCausalLM (float32) with `config` (default: `reduced(name)`), and a
    tokenizer with the checkpoint's special tokens. qk_gain > 1 sharpens attention (tests: RoPE errors show)."""
    import torch
    import transformers

    config = dict(config or reduced(name))
    if config.get("rope_scaling") is None:
        config.pop("rope_scaling", None)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(qk_gain)
            layer.self_attn.k_proj.weight.mul_(qk_gain)
        for param_name, param in model.named_parameters():  # norms away from 1, biases away from 0
            if param_name.endswith("norm.weight") or param_name.endswith(".bias"):
                param.add_(0.1 * torch.randn_like(param))
    directory = Path(directory)
    model.save_pretrained(directory)
    if tokenizer:
        write_tokenizer(directory, name, vocab_size=min(config["vocab_size"], 512))
    return directory


def write_tokenizer(directory: Path, name: str, vocab_size: int = 512) -> None:
    """A byte-level BPE trained on the builtin stories, with the checkpoint's BOS/EOS and BOS handling."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from common.data.corpus import generate_stories

    bos, eos, adds_bos = SPECIAL_TOKENS[name]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    special = list(dict.fromkeys([bos, eos]))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(generate_stories(200_000, seed=1), trainer)
    if adds_bos:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))])
    backend.save(str(Path(directory) / "tokenizer.json"))
    (Path(directory) / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
        "add_bos_token": adds_bos, "model_max_length": 2048}, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=list(REAL_CONFIGS))
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"{args.out} exists and is not empty")
    write_folder(args.out, args.name)
    print(f"wrote {args.out}: {args.name} reduced ({json.loads((args.out / 'config.json').read_text())['hidden_size']} "
          "wide, 2 layers), random weights, its special tokens")


if __name__ == "__main__":
    main()
