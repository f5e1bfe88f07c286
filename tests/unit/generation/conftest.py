"""Small causal LMs with seeded weights for the generation tests: tinylm's recipe at a small size, and a GPT-2."""

from __future__ import annotations

from pathlib import Path

import pytest

from coalesce.observability.metrics import GenerationMetrics, InMemoryMetricFactory
from coalesce.settings import ModelSettings

torch = pytest.importorskip("torch")


def generate_config(name: str = "lm", *, outputs: bool = True, **parameters: str) -> dict:
    """A decoupled config of the generate task with ``parameters``: every contract output (or only text_output)."""
    from coalesce.generation.contract import OUTPUTS

    declared = [{"name": n, "data_type": t, "dims": list(d)} for n, t, d in (OUTPUTS if outputs else OUTPUTS[:1])]
    return {"name": name, "model_transaction_policy": {"decoupled": True},
            "input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]}],
            "output": declared,
            "parameters": {"task": {"string_value": "generate"}, "max_sequence_length": {"string_value": "512"},
                           **{k: {"string_value": v} for k, v in parameters.items()}}}


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    """A version folder holding a 2-layer seeded Llama and tinylm's tokenizer in ``hf/``."""
    from coalesce_tools.export import build_tinylm

    version = tmp_path_factory.mktemp("llama")
    build_tinylm(version / "hf", seed=1, vocab_size=1024, hidden_size=64, layers=2, heads=4, kv_heads=2,
                 context=512)
    return version


@pytest.fixture(scope="session")
def gpt2_dir(llama_dir, tmp_path_factory) -> Path:
    """A version folder holding a seeded GPT-2 (learned positions, fused QKV, no GQA) with the same tokenizer."""
    import shutil

    from transformers import GPT2Config, GPT2LMHeadModel

    version = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(2)
    config = GPT2Config(vocab_size=1024, n_positions=512, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                        eos_token_id=1)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # tied with the embedding: spread logits as tinylm's recipe does
    model.save_pretrained(str(version / "hf"), safe_serialization=True)
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copyfile(llama_dir / "hf" / name, version / "hf" / name)
    return version


def make_engine(version: Path, **parameters: str):
    """An engine on ``version`` (its step thread not started: tests call ``step()``), and its metrics."""
    from coalesce.generation.loader import load_engine

    config = generate_config(**parameters)
    settings = ModelSettings.from_model_config(config)
    factory = InMemoryMetricFactory()
    engine = load_engine(config, version, settings=settings, metric_factory=factory, start=False)
    assert isinstance(engine.metrics, GenerationMetrics)
    return engine, factory
