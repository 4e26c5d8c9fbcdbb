"""Fixture builders for CPU tests: a tiny Qwen3.5 model, a ChatML tokenizer and chat data.

Kept in the package (not under tests/) so the in-container test can build the same
fixtures: `write_fixture(Path("/tmp/fx"))` writes {model/, data.jsonl, config.yaml}.
Everything is generated locally; nothing touches the network.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

# ChatML, as the Qwen family renders it (simplified: no tools, no thinking blocks).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The tiny config DESIGN.md part 2 measured (0.8M parameters).
TINY_MODEL = dict(
    hidden_size=128,
    num_hidden_layers=4,
    full_attention_interval=2,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_num_key_heads=4,
    linear_num_value_heads=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
    vocab_size=512,
    tie_word_embeddings=False,
    max_position_embeddings=4096,
)

_WORDS = (
    "the a model token data train loss step batch pack learn rate cat dog sun moon tree river "
    "red blue green one two three four five why how what when where please thanks answer question"
).split()


@dataclass(frozen=True, kw_only=True)
class Fixture:
    root: Path
    model_dir: Path        # HF model + tokenizer files (one dir, like a hub snapshot)
    data: Path             # chat JSONL
    config: Path           # finetune config YAML pointing at the above


def synthetic_conversations(n: int, *, seed: int = 0, max_turns: int = 3) -> list[dict]:
    """Chat rows in the ultrachat_200k shape. Assistant replies echo a rule of the prompt
    (reverse word order) so a tiny model has something learnable and the loss falls."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        messages = []
        for _ in range(rng.randint(1, max_turns)):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
            messages.append({"role": "user", "content": " ".join(words)})
            messages.append({"role": "assistant", "content": " ".join(reversed(words)) + " ."})
        rows.append({"prompt_id": f"p{i}", "messages": messages})
    return rows


def write_tokenizer(directory: Path, corpus: list[str], vocab_size: int = 512) -> None:
    """Train a byte-level BPE with Qwen-style special tokens and save it as a HF tokenizer dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=EOT, additional_special_tokens=[IM_START, IM_END]
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))


def write_model(directory: Path, *, seed: int = 0, pad_token_id: int = 0, eos_token_id: int = 2) -> None:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(**TINY_MODEL, pad_token_id=pad_token_id, eos_token_id=eos_token_id)
    Qwen3_5ForCausalLM(config).save_pretrained(str(directory))


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_fixture(root: Path, *, n_rows: int = 256, seed: int = 0, extra_rows: list | None = None,
                  config_overrides: dict | None = None, mount_root: str | None = None) -> Fixture:
    """Write {model/, data.jsonl, config.yaml} under root. `extra_rows` are appended as raw
    JSONL lines (dicts are dumped; strings are written verbatim, to make broken rows).

    `mount_root`: where `root` will be mounted in a container (e.g. "/fx"); the config's
    paths then point there (model, data, output.dir = <mount_root>/out)."""
    import yaml

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    model_dir = root / "model"
    rows = synthetic_conversations(n_rows, seed=seed)
    corpus = [m["content"] for r in rows for m in r["messages"]]
    write_tokenizer(model_dir, corpus)
    write_model(model_dir, seed=seed)
    data = root / "data.jsonl"
    lines = [json.dumps(r) for r in rows]
    for extra in extra_rows or ():
        lines.append(extra if isinstance(extra, str) else json.dumps(extra))
    data.write_text("\n".join(lines) + "\n")
    seen_as = Path(mount_root) if mount_root else root
    config = {
        "model": {"path": str(seen_as / "model")},
        "data": {"path": str(seen_as / "data.jsonl"), "max_length": 512},
        "packing": {"budget": 512, "shuffle_window": 64},
        # small loss chunks so the CPU tests exercise the chunked (recomputed) CE path
        "train": {"max_steps": 10, "lr": 3e-3, "warmup_steps": 2, "seed": seed, "loss_chunk_tokens": 128},
        "parallel": {"param_dtype": "float32"},
        "checkpoint": {"every": 5, "keep": 2, "export": True},
        "output": {"dir": str(seen_as / "out"), "log_every": 1},
        "launch": {"nproc_per_node": 2},
    }
    for dotted, value in (config_overrides or {}).items():
        node = config
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    cfg_path = root / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config, sort_keys=False))
    return Fixture(root=root, model_dir=model_dir, data=data, config=cfg_path)


def entrypoint_env(repo: Path | None = None, **extra: str) -> dict:
    """Environment for `python -m entrypoint` subprocesses in tests: the repo importable, no
    build lock (unless given), quiet HF progress bars."""
    import os

    repo = repo or Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("FTIMAGE_LOCK", "/nonexistent/build.lock.json")
    env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    env["TRANSFORMERS_VERBOSITY"] = "error"
    env.update(extra)
    return env


def run_entrypoint(args: list[str], *, env: dict | None = None, timeout: float = 180, **kw):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, "-m", "entrypoint", *args], cwd=repo, env=env or entrypoint_env(repo),
                          capture_output=True, text=True, timeout=timeout, **kw)
