"""The reference (issue 36): every schema key has a description and, where it takes a fixed set of values, those
values, from one place (launcher/keys_doc.py) that `--help` prints and docs/reference.md is generated from; conf
descriptions are shown whole; the generic family (a pipeline no family module claims) is documented and does what
the guide says."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from conftest import REPO

from launcher.config import CONF_DIR, JobConfig, available_confs, load_config
from launcher.errors import ConfigError
from launcher.help import help_text, keys
from launcher.keys_doc import ALLOWED, DESCRIPTIONS

SCHEMA_KEYS = [k for k, _, _ in keys(JobConfig)]


def test_every_schema_key_has_a_description_and_no_description_is_stale():
    missing = [k for k in SCHEMA_KEYS if not DESCRIPTIONS.get(k, "").strip()]
    assert not missing, f"describe these keys in launcher/keys_doc.py: {missing}"
    assert not set(DESCRIPTIONS) - set(SCHEMA_KEYS), "launcher/keys_doc.py describes keys the schema lacks"
    assert set(ALLOWED) <= set(SCHEMA_KEYS)


@pytest.mark.parametrize("key", sorted(ALLOWED))
def test_allowed_values_are_what_the_checks_accept(key):
    """Each listed value passes the preflight's settings check; a value not listed is refused naming the key."""
    from launcher.checks.settings import check_settings

    for value in ALLOWED[key]:
        check_settings(load_config("tiny", [f"{key}={value}"]))
    with pytest.raises(ConfigError, match=re.escape(key)):
        check_settings(load_config("tiny", [f"{key}=not_a_choice"]))


def _unwrapped(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_help_prints_each_keys_description_and_allowed_values_and_whole_conf_descriptions():
    text = help_text()
    flat = _unwrapped(text)
    for key in SCHEMA_KEYS:
        assert re.search(rf"^  {re.escape(key)} ", text, re.M), key
        # the description's words follow the key's line, wrapped
        assert _unwrapped(DESCRIPTIONS[key]) in flat, key
    assert "One of: auto, tpu, cuda, cpu." in flat  # device
    assert "One of: none, taylorseer, first_block, magcache." in flat  # execution.cache
    assert max(len(line) for line in text.splitlines()[9:]) <= 120  # after the usage block: wrapped
    for name in available_confs():
        comment = []
        for line in (CONF_DIR / f"{name}.yaml").read_text().splitlines():
            if not line.startswith("#"):
                break
            comment.append(line.lstrip("#").strip())
        assert _unwrapped(" ".join(comment)) in flat, name  # whole, not just its first line
    # a conf whose description is two lines long: its second line is there too
    assert "tp=2 needs 55.1 GiB (mesh.tp=auto's choice)" in flat


def test_docs_reference_is_generated_from_the_same_place_and_current():
    from tools.reference import REFERENCE, reference

    assert REFERENCE == REPO / "docs" / "reference.md"
    text = reference()
    assert REFERENCE.read_text() == text, "docs/reference.md is stale: run python -m tools.reference --write"
    for key in SCHEMA_KEYS:
        [row] = [ln for ln in text.splitlines() if ln.startswith(f"| `{key}` |")]
        assert DESCRIPTIONS[key].replace("|", "\\|") in row
    assert "| `execution.mode` |" in text and "One of: eager, defer_and_fuse, compile." in text
    assert "| `int \\| auto` |" not in text and "| int \\| auto |" in text  # a pipe in a cell is escaped


def test_the_generic_family_is_documented_and_refuses_what_it_lacks(launcher_main, capsys, tmp_path, tiny_model):
    """docs/guide.md names every family module and says what a pipeline none of them claims may not do; a dry run
    of such a pipeline (the tiny FLUX.2 under another class name) refuses tp=2 and staged execution, accepts tp=1."""
    from launcher.models import FAMILY_MODULES, GENERIC, families

    guide = _unwrapped((REPO / "docs" / "guide.md").read_text())
    assert "runs as the **generic family**" in guide
    listed = guide.split("no module in `launcher/models/` claims: families ", 1)[1].split(")", 1)[0]
    assert re.findall(r"`(\w+)`", listed) == [f.name for f in families()] and len(FAMILY_MODULES) == len(families())
    assert not (GENERIC.tp_transformer or GENERIC.max_references or GENERIC.encode or GENERIC.caches)

    model = tmp_path / "my-pipeline"
    shutil.copytree(tiny_model, model)
    index = json.loads((model / "model_index.json").read_text())
    index["_class_name"] = "MyOwnPipeline"
    (model / "model_index.json").write_text(json.dumps(index))
    base = ["--dry-run", f"model.path={model}", f"output.dir={tmp_path / 'out'}"]
    assert launcher_main([*base, "mesh.tp=2"]) == 2
    assert "MyOwnPipeline has no tensor-parallel plan" in capsys.readouterr().err
    assert launcher_main([*base, "mesh.tp=1", "execution.staged=true"]) == 2
    assert "family generic" in capsys.readouterr().err
    assert launcher_main([*base, "mesh.tp=1"]) == 0
