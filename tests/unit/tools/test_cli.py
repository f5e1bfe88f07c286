"""``coalesce``: the ``settings`` listing (every parameter of every component) and the dispatch to each subcommand."""

import pytest

from coalesce.settings import COMPONENTS, ModelSettings, parameter_fields
from coalesce_tools.cli import main, settings_rows
from tests.conftest import ROOT


def every_parameter():
    return [(attr, field) for attr, options in COMPONENTS for field in parameter_fields(options)]


def test_settings_lists_every_parameter_of_every_component_with_its_default(capsys):
    assert main(["settings"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "parameter\tdefault\tcomponent\ttasks\tmeaning"
    rows = [line.split("\t") for line in lines[1:]]
    assert all(len(row) == 5 and row[4] for row in rows)
    listed = {row[0]: row for row in rows}
    assert len(listed) == len(rows)
    expected = {field.name for _, field in every_parameter()} | {"pad_value:<input>"}
    assert set(listed) == expected
    for attr, field in every_parameter():
        _, default, component, _, meaning = listed[field.name]
        assert component == attr and meaning == field.metadata["doc"]
        # What is listed as the default parses back to the default.
        if default:
            applies = dict(COMPONENTS)[attr].APPLIES_TO  # type: ignore[attr-defined]
            task = applies[0] if applies else "embedding"
            parameters = {"task": task, field.name: default} if field.name != "task" else {field.name: default}
            parsed = ModelSettings.from_parameters(parameters, model_name="m")
            assert getattr(getattr(parsed, attr), field.name) == field.default, field.name
    assert listed["normalize"][1:4] == ["true", "embedding", "embedding, similarity"]
    assert listed["max_text_bytes"][3] == "embedding, classify, similarity"
    assert listed["max_batch_rows"][1:4] == ["64", "planner", "embedding, classify, similarity, tensor"]
    assert listed["kv_cache_bytes"][2:4] == ["generate", "generate"]
    assert listed["pad_value:<input>"][1:4] == ["0", "tensor", "tensor"]
    # pad_value:<input> sits with the tensor task's options, after mask_input.
    names = [row[0] for row in rows]
    assert names.index("pad_value:<input>") == names.index("mask_input") + 1


def test_settings_as_markdown_is_the_configuration_reference(capsys):
    assert main(["settings", "--markdown"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[:2] == ["| parameter | default | component | tasks | meaning |", "| --- | --- | --- | --- | --- |"]
    assert len(lines) == 2 + len(settings_rows())
    assert "| `pad_value:<input>` | `0` | tensor | tensor |" in out
    assert "| `redis_url` | (empty) | cache | embedding, classify, similarity, tensor |" in out
    # backends/coalesce/README.md carries the same table: regenerate it when a parameter changes.
    assert out in (ROOT / "backends" / "coalesce" / "README.md").read_text()


def test_a_subcommand_is_required_and_help_lists_them(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for command in ("serve", "prepare", "export", "settings", "tune", "build-engine"):
        assert command in out


@pytest.mark.parametrize(("command", "prog"), [("export", "coalesce export"), ("prepare", "coalesce prepare"),
                                               ("build-engine", "coalesce build-engine"), ("tune", "coalesce tune")])
def test_each_subcommand_has_its_own_help(capsys, command, prog):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {prog}")
