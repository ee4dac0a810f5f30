"""Reading results runs no code: ``sample``, ``simulate --resume``, ``experiment`` over earlier run
folders and a report of a folder import the models module a results folder's config.yaml names
only when their user names the same file (``--models-module``); otherwise one line, exit 2, and
nothing of it runs.

The folders are real runs (subprocesses, so the module never loads into this process) whose
config.yaml names, by a path relative to where they ran, a module that registers the model the
run trained and leaves a marker file beside itself whenever it is imported."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

MARKED_MODULE = '''\
"""A models module that leaves a marker beside itself whenever it runs."""
from pathlib import Path

from meshlearn.models import build_model, register_model

Path(__file__).with_name("imported").touch()


@register_model("marked-mlp")
def _mlp(input_shape, num_classes):
    return build_model("mlp", input_shape, num_classes)


@register_model("marked-gpt")
def _gpt(input_shape, num_classes):
    return build_model("gpt-tiny", input_shape, num_classes)
'''
MODULE = "mods/marked.py"  # as the runs named it: relative to the folder they ran in
RUN = ["--engine", "batched", "--nodes", "3", "--topology", "ring", "--models-module", MODULE, "--quiet"]
IMAGES = ["--model", "marked-mlp", "--iterations", "10", "--test-after", "5", "--checkpoint-every", "5",
          "--step-time", "0.001"]
TEXT = ["--dataset", "pystdlib", "--model", "marked-gpt", "--context", "16", "--batch-size", "8", "--iterations", "4",
        "--test-after", "4", "--eval-samples", "64", "--step-time", "0.001"]


def _meshlearn(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshlearn", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A folder holding the marked module and two finished runs that named it: ``images`` (digits)
    and ``text`` (a language model); the marker their runs left is removed."""
    root = tmp_path_factory.mktemp("shared")
    (root / "mods").mkdir()
    (root / MODULE).write_text(MARKED_MODULE)
    for name, extra in (("images", IMAGES), ("text", TEXT)):
        ran = _meshlearn(root, "simulate", *RUN, *extra, "--output", name)
        assert ran.returncode == 0, ran.stderr
        assert f"models_module: {MODULE}" in (root / name / "config.yaml").read_text()
    return root


@pytest.fixture
def shared(made, tmp_path):
    """A fresh copy of ``made`` for one test, its marker gone."""
    root = tmp_path / "shared"
    shutil.copytree(made, root)
    (root / "mods" / "imported").unlink(missing_ok=True)
    return root


def _refused(out: subprocess.CompletedProcess, folder: str, root: Path) -> None:
    """One line, exit 2, saying what the folder asks to import and how to allow it; nothing ran."""
    wanted = root.resolve() / MODULE
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"{folder}/config.yaml asks to import models module {wanted}" in out.stderr
    assert f"give --models-module {wanted} to allow it" in out.stderr
    assert not (root / "mods" / "imported").exists()


def test_sample_imports_a_folders_module_only_when_its_user_names_it(shared):
    _refused(_meshlearn(shared, "sample", "text", "--tokens", "5"), "text", shared)
    other = shared / "other.py"
    other.write_text("")
    _refused(_meshlearn(shared, "sample", "text", "--tokens", "5", "--models-module", str(other)), "text", shared)
    allowed = _meshlearn(shared, "sample", "text", "--tokens", "5", "--prompt", "def ",
                         "--models-module", str(shared / MODULE))  # absolute: the same file as the folder's
    assert allowed.returncode == 0 and allowed.stdout.startswith("def "), allowed.stderr
    assert (shared / "mods" / "imported").exists()


@pytest.mark.slow  # quick sibling: sample's, above: the same rule (plugins.load_folder_module), another command
def test_simulate_resume_imports_a_folders_module_only_when_its_user_names_it(shared):
    (shared / "images" / "summary.json").unlink()  # a run that stopped before its report: resumable
    _refused(_meshlearn(shared, "simulate", "--resume", "images", "--quiet"), "images", shared)
    allowed = _meshlearn(shared, "simulate", "--resume", "images", "--quiet", "--models-module", MODULE)
    assert allowed.returncode == 0, allowed.stderr
    assert (shared / "mods" / "imported").exists() and (shared / "images" / "summary.json").is_file()


def test_an_experiment_over_earlier_run_folders_imports_only_its_own_files_module(shared):
    # the experiment file names no module; its run's folder holds an earlier run that named one
    (shared / "out").mkdir()
    shutil.copytree(shared / "images", shared / "out" / "a")
    (shared / "out" / "a" / "summary.json").unlink()  # a run stopped half-way, which an experiment goes on with
    (shared / "e.yaml").write_text("name: e\nbase: {engine: batched, nodes: 3, topology: ring, iterations: 10, "
                                   "test_after: 5, checkpoint_every: 5, step_time: 0.001}\nruns:\n  - {name: a}\n")
    for restart in ([], ["--restart"]):
        ran = _meshlearn(shared, "experiment", "e.yaml", "--output", "out", "--quiet", *restart)
        assert ran.returncode == 0, ran.stderr
        assert not (shared / "mods" / "imported").exists()
        assert "models_module: null" in (shared / "out" / "a" / "config.yaml").read_text()  # the file's own run
        shutil.rmtree(shared / "out" / "a")
        shutil.copytree(shared / "images", shared / "out" / "a")


def _report(root: Path, allowed: str | None) -> subprocess.CompletedProcess:
    call = "write_report('images')" if allowed is None else f"write_report('images', models_module={allowed!r})"
    return subprocess.run([sys.executable, "-c", f"from meshlearn.sim import write_report; {call}"], cwd=root,
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow  # quick sibling: sample's, above: the same rule (plugins.load_folder_module), another command
def test_a_report_of_a_folder_imports_its_module_only_when_its_caller_names_it(shared):
    for figure in ("summary.json", "accuracy.png", "predictions.png"):
        (shared / "images" / figure).unlink()
    written = _report(shared, None)
    assert written.returncode == 0, written.stderr
    assert (shared / "images" / "summary.json").is_file() and (shared / "images" / "accuracy.png").is_file()
    assert not (shared / "mods" / "imported").exists()
    assert not (shared / "images" / "predictions.png").exists()  # the figure that would need the module
    written = _report(shared, MODULE)
    assert written.returncode == 0, written.stderr
    assert (shared / "mods" / "imported").exists() and (shared / "images" / "predictions.png").is_file()
