"""Placement fields in the config, the pure placement decisions (services/placement.py) and the
bundles learner files travel in (learner/files.py). No Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from config import ConfigError, config_from_dict
from learner.files import pack, unpack, write_bundle
from services.placement import Held, Node, needs_of, node_loss_message, placement_problems, selector_matches

BASE = {"model": {"name_or_path": "tiny-random"}}


def cfg(**sections):
    return config_from_dict({**BASE, **sections})


def test_placement_defaults_are_no_constraint():
    c = cfg()
    assert c.rollout.resources == {} and c.rollout.label_selector == {}
    assert c.learner.resources_per_worker == {} and c.learner.label_selector == {}
    assert c.grader.resources == {} and c.grader.label_selector == {}


@pytest.mark.parametrize("sections, match", [
    ({"rollout": {"resources": {"CPU": 1}}}, "rollout.resources names Ray's own resource 'CPU'"),
    ({"learner": {"resources_per_worker": {"slot": 0}}}, r"learner.resources_per_worker\['slot'\] must"),
    ({"grader": {"label_selector": {"role": "in(a"}}}, "grader.label_selector: 'role': 'in\\(a' is not a label selector"),
])
def test_bad_placement_is_one_line(sections, match):
    with pytest.raises(ConfigError, match=match) as err:
        cfg(**sections)
    assert len(str(err.value).strip().splitlines()) == 1


def test_selector_semantics():
    labels = {"role": "rollout", "zone": "a"}
    assert selector_matches({"role": "rollout"}, labels)
    assert not selector_matches({"role": "learner"}, labels)
    assert selector_matches({"role": "!learner"}, labels) and not selector_matches({"role": "!rollout"}, labels)
    assert selector_matches({"zone": "in(a,b)"}, labels) and not selector_matches({"zone": "!in(a,b)"}, labels)
    assert selector_matches({"gpu": "!yes"}, labels)  # absent counts as different
    assert selector_matches({}, labels)


NODES = [
    Node("head0000000000", True, {"counterpoint-role": "head"}, {"CPU": 1}),
    Node("roll0000000000", True, {"counterpoint-role": "rollout"}, {"CPU": 1, "rollout_slot": 1}),
    Node("lear0000000000", True, {"counterpoint-role": "learner"}, {"CPU": 1, "learner_slot": 1}),
]


def placed(**over):
    sections = {"rollout": {"resources": {"rollout_slot": 1}}, "learner": {"resources_per_worker": {"learner_slot": 1}},
                "grader": {"label_selector": {"counterpoint-role": "head"}}}
    for k, v in over.items():
        sections[k] = {**sections[k], **v}
    return cfg(**sections)


def test_placement_problems_name_the_part_and_its_fields():
    assert placement_problems(NODES, needs_of(placed())) == []
    (line,) = placement_problems(NODES, needs_of(placed(learner={"label_selector": {"counterpoint-role": "gpu"}})))
    assert line.startswith("no live node can hold a learner worker") and "label_selector" in line
    dead = [NODES[0], NODES[1], Node("lear0000000000", False, NODES[2].labels, NODES[2].resources)]
    assert [p.split(" (")[0] for p in placement_problems(dead, needs_of(placed()))] == [
        "no live node can hold a learner worker"]


def test_node_loss_message_names_node_what_it_held_and_the_resume():
    dead = [NODES[0], NODES[1], Node("lear0000000000", False, NODES[2].labels, NODES[2].resources)]
    held = [Held("learner", "rank 0", "lear0000000000", 42), Held("rollout", "replica ab", "roll0000000000")]
    lost = {"lear0000000000": [held[0]]}
    msg = node_loss_message(lost, dead, needs_of(placed()), "/runs/r")
    assert msg is not None and "\n" not in msg
    assert "node lear00000000 (counterpoint-role=learner) is gone, it held learner rank 0 (pid 42)" in msg
    assert msg.endswith("counterpoint train --resume /runs/r")
    # a lost part that another live node can take over is no reason to stop
    assert node_loss_message({"roll0000000000": [held[1]]}, NODES, needs_of(placed()), "/r") is None


def test_bundles_round_trip_and_never_overwrite_a_record(tmp_path: Path):
    src = tmp_path / "src"
    (src / "checkpoints" / "step_1").mkdir(parents=True)
    (src / "checkpoints" / "step_1" / "state.json").write_text("{}")
    (src / "adapters" / "step_1").mkdir(parents=True)
    (src / "adapters" / "step_1" / "adapter_model.safetensors").write_bytes(b"\0\1")
    files = pack(src)
    assert set(files) == {"checkpoints/step_1/state.json", "adapters/step_1/adapter_model.safetensors"}
    run = tmp_path / "run"
    write_bundle(files, run)
    assert pack(run) == files
    write_bundle(files, run)  # the same bytes again (a restored learner re-sends adapters/init): fine
    with pytest.raises(FileExistsError, match="overwrite a record"):
        write_bundle({"checkpoints/step_1/state.json": b"other"}, run)
    assert not list(run.rglob(".*partial*"))
    with pytest.raises(ValueError, match="leaves its root"):
        unpack({"../x": b""}, tmp_path / "u")
