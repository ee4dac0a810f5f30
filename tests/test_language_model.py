"""Language models: text corpora as token windows, the language-model task's metrics, a small GPT
trained by both engines."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from meshlearn.config import make_config
from meshlearn.data import load_dataset, partition_dataset
from meshlearn.data.text import HELD_OUT_EVERY, load_text, split_files, stdlib_files, stdlib_root
from meshlearn.errors import ConfigError, DatasetError, ModelError
from meshlearn.models import build_model
from meshlearn.sim import simulate
from meshlearn.tasks import TASKS, resolve_task

# --- the corpora ------------------------------------------------------------------------------------


def test_the_standard_library_corpus_is_its_own_code_in_a_fixed_order_with_every_tenth_file_held_out():
    files = stdlib_files()
    root = stdlib_root()
    names = [f.relative_to(root).as_posix() for f in files]
    assert names == sorted(names) and len(names) > 300 and "os.py" in names and "json/decoder.py" in names
    assert not any(part in ("test", "tests", "site-packages", "__pycache__") for n in names for part in n.split("/"))
    train, test = split_files(files)
    assert test == list(range(HELD_OUT_EVERY - 1, len(files), HELD_OUT_EVERY)) and sorted(train + test) == list(
        range(len(files)))
    dataset = load_dataset("pystdlib", context=64)
    assert dataset.task == "language-model" and dataset.input_shape == (64,) and dataset.num_classes == 256
    assert dataset.train_x.dtype == torch.uint8 and dataset.normalize(dataset.train_x[:2]).dtype == torch.int64
    stream = b"".join(files[i].read_bytes() for i in train)
    assert bytes(dataset.train_x[:3].flatten().tolist()) == stream[:192]  # windows: the stream, cut in 64s
    assert torch.equal(dataset.train_y[0][:-1], dataset.train_x[0][1:])  # the next token at every position
    assert int(dataset.train_y[0][-1]) == int(dataset.train_x[1][0])
    held_out = files[test[0]].read_bytes()
    assert bytes(dataset.test_x[:1].flatten().tolist()) == held_out[:64]
    assert held_out[:200] not in stream  # the test set is text no node trains on
    groups = dataset.train_groups.numpy()
    assert groups[0] == 0 and groups[-1] == len(train) - 1 and bool(np.all(np.diff(groups) >= 0))


def test_a_text_folder_is_read_once_into_the_cache_and_a_single_file_split_at_nine_tenths(tmp_path, monkeypatch):
    folder = tmp_path / "corpus"
    (folder / "b").mkdir(parents=True)
    for i in range(10):
        (folder / ("b" if i % 2 else ".") / f"{i:02d}.txt").write_text(f"file {i} " * 50)
    dataset = load_text(folder, context=16)
    assert bytes(dataset.test_x[0].tolist()) == b"file 9 file 9 fi"  # 10 files: the 10th (in path order) held out
    import meshlearn.data.text as text

    monkeypatch.setattr(text, "_read", lambda path: pytest.fail("read again"))
    again = load_text(folder, context=8)  # another context: the same cached streams
    assert bytes(again.train_x[0].tolist()) == b"file 0 f"
    monkeypatch.undo()
    one = tmp_path / "one.txt"
    one.write_bytes(bytes(range(100)) * 10)
    single = load_text(one, context=10)
    assert single.train_x.shape == (89, 10) and int(single.test_x[0][0]) == 900 % 100
    with pytest.raises(DatasetError, match="its test text has 100 tokens, too few for one window of 100"):
        load_text(one, context=100)
    pair = tmp_path / "pair"
    pair.mkdir()
    for name in ("a.txt", "b.txt"):
        (pair / name).write_text(f"{name} " * 40)
    assert bytes(load_text(pair, context=8).test_x[0].tolist()) == b"b.txt b."  # of fewer than ten: the last
    with pytest.raises(DatasetError, match="no .txt files"):
        load_text(_empty(tmp_path), context=8)


def _empty(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    return empty


def test_text_is_dealt_out_by_window_or_by_whole_files_never_by_label():
    dataset = load_dataset("pystdlib", context=256)
    by_file = partition_dataset(dataset, 8, "writers", seed=1)
    groups = dataset.train_groups.numpy()
    files = [set(groups[part].tolist()) for part in by_file]
    assert all(not (a & b) for k, a in enumerate(files) for b in files[k + 1:])  # no file on two nodes
    iid = partition_dataset(dataset, 8, "iid", seed=1)
    assert sum(len(p) for p in iid) == len(dataset.train_x)
    with pytest.raises(DatasetError, match="which text has none of"):
        partition_dataset(dataset, 8, "dirichlet:0.1", seed=1)


# --- the task --------------------------------------------------------------------------------------


def test_the_language_models_metrics_by_hand():
    task = TASKS.get("language-model")()
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]]))  # one window of two positions
    targets = torch.tensor([[0, 2]], dtype=torch.uint8)
    total = float(task.loss_sums(logits.unsqueeze(0), targets)[0])
    assert total == pytest.approx(-math.log(0.5) - math.log(0.1))
    evaluation = task.evaluation(total, targets, task.predictions(logits).flatten(), 3)
    assert evaluation.loss == pytest.approx(total / 2)  # per token
    assert evaluation.perplexity == pytest.approx(math.sqrt(1 / (0.5 * 0.1)))
    assert evaluation.bits_per_token == pytest.approx(evaluation.loss / math.log(2))
    assert evaluation.accuracy == 0.5 and evaluation.confusion == []
    classification = TASKS.get("classification")().evaluation(total, targets.flatten(), torch.tensor([0, 1]), 3)
    assert classification.perplexity is None and "perplexity" not in classification.as_dict()


def test_a_character_vocabulary_for_images_is_one_clear_error():
    with pytest.raises(ConfigError, match="vocabulary chars is for text datasets"):
        make_config({"dataset": "digits", "vocabulary": "chars"})


@pytest.mark.parametrize("asked,dataset,problem", [
    ("language-model", "digits", "task language-model cannot learn from dataset digits"),
    ("classification", "pystdlib", "task classification cannot learn from dataset pystdlib"),
])
def test_a_task_its_dataset_cannot_serve_is_one_clear_error(asked, dataset, problem):
    with pytest.raises(ConfigError, match=problem):
        resolve_task(asked, "language-model" if dataset == "pystdlib" else "classification", dataset)
    with pytest.raises(ConfigError, match="unknown task 'poetry'"):
        make_config({"task": "poetry"})


def test_a_gpt_reads_token_windows_and_an_image_model_refuses_them():
    model = build_model("gpt-tiny", (32,), 256)
    assert 0.8e6 < sum(p.numel() for p in model.parameters()) < 1.2e6
    assert model(torch.zeros(2, 32, dtype=torch.int64)).shape == (2, 32, 256)
    assert 10e6 < sum(p.numel() for p in build_model("gpt-small", (256,), 256).parameters()) < 25e6
    with pytest.raises(ModelError, match="gpt-tiny reads token sequences"):
        build_model("gpt-tiny", (1, 8, 8), 10)
    with pytest.raises(ModelError, match="model mlp reads images"):
        build_model("mlp", (32,), 256)


# --- training ---------------------------------------------------------------------------------------


@pytest.mark.slow  # test_simulate_prints_a_language_models_perplexity trains a gpt in the default run
def test_a_quick_gpt_run_on_the_standard_library_learns_and_reports_perplexity(tmp_path):
    config = make_config({"engine": "batched", "nodes": 4, "topology": "ring", "dataset": "pystdlib",
                          "model": "gpt-tiny", "context": 32, "batch_size": 16, "iterations": 30, "optimizer": "adam",
                          "lr": 0.003, "test_after": 15, "eval_samples": 256, "step_time": 0.01, "seed": 1,
                          "output": str(tmp_path / "lm")})
    simulate(config, progress=False)
    final = json.loads((tmp_path / "lm" / "summary.json").read_text())["final"]
    assert final["perplexity"] < 40 < 256  # from a uniform guess over 256 bytes
    assert final["perplexity"] == pytest.approx(math.exp(final["loss"]), rel=0.05)
    assert final["bits_per_token"] == pytest.approx(final["loss"] / math.log(2))
    import csv

    rows = list(csv.DictReader((tmp_path / "lm" / "summary.csv").open()))
    assert [int(r["iteration"]) for r in rows] == [15, 30]  # the perplexity curve, beside the loss
    assert float(rows[-1]["test_perplexity_mean"]) == pytest.approx(final["perplexity"])
    assert float(rows[0]["test_perplexity_mean"]) > float(rows[-1]["test_perplexity_mean"])
    assert (tmp_path / "lm" / "perplexity.png").stat().st_size > 1000


@pytest.mark.slow  # a quick GPT run learns and reports its perplexity in the default run
def test_every_algorithm_trains_a_gpt_on_the_batched_engine(tmp_path):
    from meshlearn.definitions.base import DEFINITIONS

    for algorithm in DEFINITIONS.names():
        optimizer = "sgd" if algorithm in ("gossip", "leader", "qgdsgdm") else "adam"  # asynchronous nodes: SGD;
        # quasi-global momentum: SGD's momentum buffer
        config = make_config({"engine": "batched", "algorithm": algorithm, "nodes": 4, "topology": "ring",
                              "dataset": "pystdlib", "model": "gpt-tiny", "context": 8, "batch_size": 4,
                              "iterations": 6, "test_after": 6, "eval_samples": 16, "optimizer": optimizer,
                              "lr": 0.003 if optimizer == "adam" else 0.1, "step_time": 0.01,
                              "momentum": 0.9 if algorithm == "qgdsgdm" else 0.0,
                              "output": str(tmp_path / algorithm)})
        simulate(config, progress=False)
        final = json.loads((tmp_path / algorithm / "summary.json").read_text())["final"]
        assert math.isfinite(final["perplexity"]) and final["perplexity"] < 60, (algorithm, final)  # uniform: 256


def test_simulate_prints_a_language_models_perplexity(tmp_path):
    out = subprocess.run([sys.executable, "-m", "meshlearn", "simulate", "--engine", "batched", "--nodes", "2",
                          "--dataset", "pystdlib", "--model", "gpt-tiny", "--context", "16", "--iterations", "2",
                          "--batch-size", "4", "--eval-samples", "16", "--output", str(tmp_path / "cli")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "test perplexity" in out.stdout and "bits per token" in out.stdout and "test accuracy" not in out.stdout
    assert "perplexity.png, model.safetensors" in out.stdout


def test_a_users_task_from_the_models_module_is_what_the_nodes_minimize(tmp_path):
    import csv

    from meshlearn.sim.checks import check_before_start

    with pytest.raises(ConfigError, match="unknown task 'doubled'"):
        make_config({"task": "doubled"})  # without its module
    module = tmp_path / "doubled.py"
    module.write_text(
        "from torch.nn import functional as F\n"
        "from meshlearn.tasks import Task, register_task\n\n"
        "@register_task\n"
        "class Doubled(Task):\n"
        "    name = 'doubled'\n"
        "    def loss(self, outputs, targets):\n"
        "        return 2 * F.cross_entropy(outputs, targets.long())\n")
    first_loss = {}
    for task in ("doubled", "auto"):  # doubled first: its config names the module that registers it
        config = make_config({"engine": "batched", "nodes": 4, "dataset": "digits", "iterations": 1, "test_after": 1,
                              "step_time": 0.001, "task": task, "models_module": str(module),
                              "output": str(tmp_path / task)})
        check_before_start(config)
        simulate(config, progress=False)
        rows = list(csv.DictReader((tmp_path / task / "summary.csv").open()))
        first_loss[task] = float(rows[0]["train_loss_mean"])
    # the same first batch of the same initial model: the task's loss, twice the cross-entropy
    assert first_loss["doubled"] == pytest.approx(2 * first_loss["auto"], rel=1e-5)


@pytest.mark.slow  # test_a_run_on_shakespeares_characters_samples_in_them samples a run's model in the default run
def test_sample_continues_a_prompt_with_the_runs_final_model(tmp_path):
    from meshlearn.evaluation import evaluate_model
    from meshlearn.models import load_weights
    from meshlearn.sim.sample import continue_text

    run = tmp_path / "lm"
    config = make_config({"engine": "batched", "nodes": 3, "topology": "ring", "dataset": "pystdlib",
                          "model": "gpt-tiny", "context": 16, "batch_size": 8, "iterations": 4, "optimizer": "adam",
                          "lr": 0.003, "test_after": 4, "eval_samples": 64, "step_time": 0.01, "output": str(run)})
    simulate(config, progress=False)
    node0 = json.loads((run / "summary.json").read_text())["per_node"]["0"]["metrics"]
    model = build_model("gpt-tiny", (16,), 256)
    load_weights(model, str(run / "model.safetensors"))  # node 0's final model
    again = evaluate_model(model, load_dataset("pystdlib", context=16), limit=64)
    assert again.perplexity == pytest.approx(node0["perplexity"], rel=1e-4)
    greedy = continue_text(run, "import ", tokens=30, temperature=0)
    assert 0 < len(greedy) <= 30 and greedy == continue_text(run, "import ", tokens=30, temperature=0)
    out = subprocess.run([sys.executable, "-m", "meshlearn", "sample", str(run), "--prompt", "def ", "--tokens", "20"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("def ") and len(out.stdout) > 5, out.stderr
    refused = subprocess.run([sys.executable, "-m", "meshlearn", "sample", str(tmp_path)], capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2 and "holds no finished run's config.yaml" in refused.stderr
    assert "Traceback" not in refused.stderr


# --- vocabularies and LEAF's Shakespeare --------------------------------------------------------------


def test_a_character_vocabulary_by_hand():
    from meshlearn.data.vocabulary import Vocabulary

    chars = Vocabulary.of_text("chars", ["abca", "b\u00e9"])
    assert chars.chars == "abc\u00e9" and chars.size == 5 and chars.names()[-1] == "\ufffd"
    assert chars.encode("abz\u00e9").tolist() == [0, 1, 4, 3]  # z is no character of the training text
    assert chars.decode([0, 3, 4]) == "a\u00e9\ufffd" and chars.encode(b"c\xc3\xa9").tolist() == [2, 3]
    assert Vocabulary.from_metadata(chars.metadata()) == chars == Vocabulary.of_names(chars.names())
    raw = Vocabulary.of_text("bytes", [])
    assert raw.size == 256 and raw.encode("\u00e9").tolist() == [0xC3, 0xA9] and raw.decode([0xC3, 0xA9]) == "\u00e9"
    assert Vocabulary.from_metadata({}) == raw == Vocabulary.of_names(raw.names())  # a model file without one
    many = "".join(chr(0x100 + i) * (i + 1) for i in range(300))  # 300 characters, the later the more frequent
    kept = Vocabulary.of_text("chars", [many])
    assert kept.size == 256 and kept.chars == "".join(chr(0x100 + i) for i in range(45, 300))
    assert kept.encode(chr(0x100)).tolist() == [255]  # one of the rarest: the unknown token
    for garbled in ({"meshlearn.vocabulary": "{"}, {"meshlearn.vocabulary": '{"kind": "chars", "chars": "ba"}'},
                    {"meshlearn.vocabulary": '{"kind": "words", "chars": "ab"}'},
                    {"meshlearn.vocabulary": "[" * 100_000 + "]" * 100_000}):
        with pytest.raises(DatasetError, match="vocabulary"):
            Vocabulary.from_metadata(garbled)
    stdlib = load_dataset("pystdlib", context=64, vocabulary="chars")
    first = stdlib_files()[0].read_text()
    assert stdlib.num_classes == len(set("".join(f.read_text() for f in stdlib_files()[:20])) | set(stdlib.class_names))
    assert Vocabulary.of_names(stdlib.class_names).decode(stdlib.train_x[0].tolist()) == first[:64]
    assert stdlib.train_x.dtype == torch.uint8 and int(stdlib.train_x.max()) < stdlib.num_classes


SPEECHES = {"HAMLET": "To be, or not to be, that is the question: ",
            "OPHELIA": "O, what a noble mind is here o'erthrown! ",
            "POLONIUS": "Brevity is the soul of wit. "}


def _shakespeare(root, window=8):
    """A LEAF Shakespeare folder: each writer's text as sliding samples of ``window`` characters and
    the next one, as LEAF's preprocessing writes them (OPHELIA's with one sample out of place)."""
    def samples(text):
        return {"x": [text[i:i + window] for i in range(len(text) - window)],
                "y": [text[i + window] for i in range(len(text) - window)]}

    train = {name: samples(text * 3) for name, text in SPEECHES.items()}
    train["OPHELIA"]["x"].insert(5, "jumbled!")
    train["OPHELIA"]["y"].insert(5, "?")
    test = {"HORATIO": samples("Now cracks a noble heart. Good night, sweet prince. ")}
    for split, users in (("train", train), ("test", test)):
        (root / split).mkdir(parents=True)
        (root / split / "all_data.json").write_text(json.dumps({"users": list(users), "num_samples": [
            len(u["y"]) for u in users.values()], "user_data": users}))
    return root


def test_leafs_shakespeare_is_each_writers_text_rebuilt_from_its_samples(tmp_path):
    from meshlearn.data.text import leaf_holds_text, leaf_writer_text
    from meshlearn.data.vocabulary import Vocabulary

    assert leaf_writer_text(["abcdefgh", "bcdefghi", "xyzwvuts", "yzwvutsr"], ["i", "j", "r", "!"]) == \
        "abcdefghijxyzwvutsr!"
    # a split by sample leaves gaps: a later window adds only what goes past the text so far
    assert leaf_writer_text(["abcdefgh", "defghijk", "hijklmno"], ["i", "l", "p"]) == "abcdefghijklmnop"
    root = _shakespeare(tmp_path / "shakespeare")
    assert leaf_holds_text(root)
    dataset = load_dataset(f"leaf:{root}", context=8, vocabulary="chars")
    vocab = Vocabulary.of_names(dataset.class_names)
    texts = [t * 3 for t in SPEECHES.values()]
    # a sample out of place adds itself and its next character; the one after it, all its window again
    texts[1] = texts[1][:5 + 8] + "jumbled!?" + texts[1][5:]
    stream = vocab.decode(dataset.train_x.flatten().tolist())
    assert "".join(texts).startswith(stream) and len(stream) > len("".join(texts)) - 8
    assert vocab.chars == "".join(sorted(set("".join(texts))))  # the training text's characters only
    # a test character the training text lacks (N, c) reads as the unknown token
    assert vocab.decode(dataset.test_x[0].tolist()) == "\ufffdow \ufffdra\ufffd"
    groups = dataset.train_groups.tolist()  # the writer of each window: partition writers gives whole speeches
    assert groups[0] == 0 and groups[-1] == 2 and groups == sorted(groups)
    assert load_dataset(f"leaf:{root}", context=8).num_classes == 256  # bytes, by default
    femnist = tmp_path / "femnist"
    for split in ("train", "test"):
        (femnist / split).mkdir(parents=True)
        (femnist / split / "d.json").write_text(json.dumps({"users": ["w"], "user_data": {
            "w": {"x": [[0.5] * 16, [0.0] * 16], "y": [1, 0]}}}))
    assert not leaf_holds_text(femnist) and load_dataset(f"leaf:{femnist}").task == "classification"
    # LEAF's split by sample (a writer on both sides): every tenth writer (of three, the last) is held out instead
    by_sample = _shakespeare(tmp_path / "by-sample")
    test = json.loads((by_sample / "test" / "all_data.json").read_text())
    test["users"], test["user_data"] = ["HAMLET"], {"HAMLET": test["user_data"]["HORATIO"]}
    (by_sample / "test" / "all_data.json").write_text(json.dumps(test))
    held = load_dataset(f"leaf:{by_sample}", context=8, vocabulary="chars")
    held_vocab = Vocabulary.of_names(held.class_names)
    polonius = "".join(c if c in held_vocab.chars else "\ufffd" for c in list(SPEECHES.values())[2] * 3)
    assert held_vocab.decode(held.test_x.flatten().tolist()) == polonius[:len(held.test_x) * 8]
    assert held.train_groups.tolist()[-1] == 1  # HAMLET's and OPHELIA's texts train


def test_a_run_on_shakespeares_characters_samples_in_them(tmp_path):
    from meshlearn.data.vocabulary import Vocabulary
    from meshlearn.sim.sample import continue_text

    root = _shakespeare(tmp_path / "shakespeare")
    run = tmp_path / "run"
    simulate(make_config({"engine": "batched", "nodes": 3, "topology": "ring", "dataset": f"leaf:{root}",
                          "vocabulary": "chars", "partition": "writers", "model": "gpt-tiny", "context": 8,
                          "batch_size": 4, "iterations": 3, "optimizer": "adam", "lr": 0.003, "test_after": 3,
                          "step_time": 0.01, "output": str(run)}), progress=False)
    vocab = Vocabulary.of_names(load_dataset(f"leaf:{root}", context=8, vocabulary="chars").class_names)
    written = continue_text(run, "To be", tokens=40, temperature=1.0)
    assert len(written) == 40 and set(written) <= set(vocab.names())  # one character a token, of the vocabulary


# --- what a provider accepts of a task's text -------------------------------------------------------


def _meta(**changes):
    return {"name": "text", "num_classes": 256, "class_names": ["x"] * 256, "mean": [], "std": [],
            "task": "language-model", **changes}


def _windows(n, t, dtype=torch.uint8):
    x = torch.randint(0, 256, (n, t), dtype=torch.int64).to(dtype)
    return x, x.clone()


@pytest.mark.parametrize("meta,train,test,problem", [
    (_meta(task="poetry"), _windows(4, 8), _windows(2, 8), "providers train classification or language-model"),
    (_meta(num_classes=512), _windows(4, 8), _windows(2, 8), "a vocabulary of 2 to 256 named tokens"),
    (_meta(num_classes=10, class_names=list("0123456789")), _windows(4, 8), _windows(2, 8), "tokens outside 0..9"),
    (_meta(class_names=["x"] * 10), _windows(4, 8), _windows(2, 8), "a vocabulary of 2 to 256 named tokens"),
    (_meta(), _windows(4, 0), _windows(2, 0), "a vocabulary of 2 to 256 named tokens"),  # empty windows
    (_meta(), _windows(4, 8), _windows(2, 16), "not shaped like its training samples"),
    (_meta(mean=[0.5], std=[0.2]), _windows(4, 8), _windows(2, 8), "does not fit a language model"),
    ({"name": "x"}, _windows(4, 8), _windows(2, 8), "lacks or garbles"),
    (_meta(task="classification", num_classes=10, mean=[], std=[]), (torch.zeros(4, 1, 8, 8), torch.zeros(4)),
     (torch.zeros(2, 1, 8, 8), torch.zeros(2)), "a mean and a positive std per channel"),
])
def test_a_provider_refuses_text_shards_that_do_not_fit_their_description(meta, train, test, problem):
    from meshlearn.network.channel.envelope import NetworkError
    from meshlearn.network.task.datashare import dataset_from_shards

    with pytest.raises(NetworkError, match=problem):
        dataset_from_shards(meta, train, test)
    assert dataset_from_shards(_meta(), _windows(4, 8), _windows(2, 8)).tokens  # the same, well formed
