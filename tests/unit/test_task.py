"""Loading and checking a task: every way a user's task can be wrong gets one clear
TaskError naming the task and the problem."""

import math

import pytest
import torch

from diloco.errors import InvalidArgument
from diloco.task import Task, TaskContext, TaskError, build_task, checked_loss, checked_tokens, evaluate, parse_options

CTX = TaskContext(0, 1, 0, torch.device("cpu"), {"scale": "2"})

GOOD = '''
import torch, diloco

def build(ctx):
    model = torch.nn.Linear(2, 1)
    batch = (torch.ones(4, 2), torch.zeros(4, 1))
    loss = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
    return diloco.Task(model=model, batches=iter([batch]), loss=loss, tokens=lambda b: 4,
                       eval_batches=[batch], eval_scale=ctx.option("scale", 1.0, float))

def raises(ctx):
    raise RuntimeError("no GPU here")

def wrong(ctx):
    return {"model": None}

def frozen(ctx):
    task = build(ctx)
    for p in task.model.parameters():
        p.requires_grad_(False)
    return task

not_a_function = 3
'''


@pytest.fixture
def task_file(tmp_path):
    path = tmp_path / "mytask.py"
    path.write_text(GOOD)
    return path


def test_a_task_file_and_a_module_load_and_evaluate(task_file):
    task = build_task(f"{task_file}:build", CTX)
    with torch.no_grad():
        expected = 2 * float(torch.nn.functional.mse_loss(task.model(torch.ones(4, 2)), torch.zeros(4, 1)))
    assert evaluate("t", task) == pytest.approx(expected)
    assert task.model.training  # evaluate puts the model back in train mode
    gpt = build_task("diloco.tasks.byte_gpt:build", TaskContext(0, 1, 0, torch.device("cpu"), {"width": "16", "heads": "2", "depth": "1", "context": "16", "eval_batches": "1"}))
    assert gpt.eval_unit == "bits/byte" and gpt.eval_scale == pytest.approx(1 / math.log(2))


@pytest.mark.parametrize("suffix, message", [
    (":raises", "raised RuntimeError: no GPU here"),
    (":wrong", "returned dict, not diloco.Task"),
    (":frozen", "no trainable parameters"),
    (":missing", "has no function 'missing'"),
    (":not_a_function", "has no function 'not_a_function'"),
])
def test_bad_tasks_name_the_task_and_the_problem(task_file, suffix, message):
    with pytest.raises(TaskError) as error:
        build_task(f"{task_file}{suffix}", CTX)
    assert str(task_file) in str(error.value) and message in str(error.value)


def test_tasks_that_do_not_import(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(TaskError, match="does not import: ModuleNotFoundError"):
        build_task(f"{broken}:build", CTX)
    with pytest.raises(TaskError, match="no such file"):
        build_task(f"{tmp_path}/nope.py:build", CTX)
    with pytest.raises(TaskError, match="expected FILE.py:FUNCTION"):
        build_task("no_colon", CTX)
    with pytest.raises(TaskError, match="does not import"):
        build_task("no.such.module:build", CTX)


def test_losses_and_token_counts_are_checked():
    w = torch.ones(3, requires_grad=True)
    assert checked_loss("t", (w * 2).sum()) is not None
    with pytest.raises(TaskError, match="not a scalar"):
        checked_loss("t", w * 2)
    with pytest.raises(TaskError, match="not a tensor"):
        checked_loss("t", 1.0)
    with pytest.raises(TaskError, match="does not depend"):
        checked_loss("t", torch.tensor(1.0))
    assert checked_tokens("t", 7) == 7 and checked_tokens("t", torch.tensor(5)) == 5
    for bad in (-1, 2.5, True, torch.tensor(1.5), None):
        with pytest.raises(TaskError, match="not a non-negative int"):
            checked_tokens("t", bad)


def test_nan_eval_loss_is_a_task_error(task_file):
    task = build_task(f"{task_file}:build", CTX)
    task.eval_batches = [(torch.full((4, 2), float("nan")), torch.zeros(4, 1))]
    with pytest.raises(TaskError, match="eval loss is nan"):
        evaluate("t", task)
    task.eval_batches = None
    assert evaluate("t", task) is None


def test_options_and_their_conversion():
    assert parse_options(["a=1", "b = x=y"]) == {"a": "1", "b": " x=y"}
    with pytest.raises(InvalidArgument):
        parse_options(["novalue"])
    with pytest.raises(InvalidArgument, match="task option n='2.5' is not a valid int"):
        TaskContext(0, 1, 0, "cpu", {"n": "2.5"}).option("n", 0, int)
    assert CTX.option("absent", 5, int) == 5 and Task.__dataclass_fields__["eval_unit"].default == "loss"


def test_options_the_task_never_reads_are_refused_by_name(task_file):
    with pytest.raises(InvalidArgument) as error:
        build_task(f"{task_file}:build", TaskContext(0, 1, 0, "cpu", {"scale": "2", "scael": "3", "lr": "1"}))
    assert str(error.value) == (f"task '{task_file}:build' never reads task options lr, scael (did you mean scale?); "
                                "it reads scale")
    gpt = {"width": "16", "heads": "2", "depth": "1", "context": "16", "eval_batches": "1"}
    with pytest.raises(InvalidArgument, match=r"never reads task option d_modle; it reads batch_size, context, data, "):
        build_task("diloco.tasks.byte_gpt:build", TaskContext(0, 1, 0, "cpu", {**gpt, "d_modle": "64"}))
    with pytest.raises(InvalidArgument, match=r"option widht \(did you mean width\?\)"):
        build_task("diloco.tasks.byte_gpt:build", TaskContext(0, 1, 0, "cpu", {**gpt, "widht": "64"}))


def test_options_looked_up_any_way_count_as_read(tmp_path):
    path = tmp_path / "lookups.py"
    path.write_text(GOOD + '''
def lookups(ctx):
    assert "a" in ctx.options and ctx.options.get("b") == "2" and ctx.options["c"] == "3"
    return build(ctx)

def every(ctx):
    assert dict(ctx.options) == {"a": "1", "b": "2", "c": "3"}
    return build(ctx)
''')
    for name in ("lookups", "every"):
        build_task(f"{path}:{name}", TaskContext(0, 1, 0, "cpu", {"a": "1", "b": "2", "c": "3"}))


def test_init_weights_load_into_the_model_or_say_why_not(task_file, tmp_path):
    from safetensors.torch import save_file

    good = tmp_path / "good.safetensors"
    save_file({"weight": torch.full((1, 2), 0.5), "bias": torch.zeros(1)}, str(good))
    task = build_task(f"{task_file}:build", CTX, str(good))
    assert torch.equal(task.model.weight.detach(), torch.full((1, 2), 0.5))
    wrong = tmp_path / "wrong.safetensors"
    save_file({"weight": torch.zeros(3, 3)}, str(wrong))
    with pytest.raises(TaskError, match="does not fit the model of task"):
        build_task(f"{task_file}:build", CTX, str(wrong))
    with pytest.raises(TaskError, match="cannot read it"):
        build_task(f"{task_file}:build", CTX, str(tmp_path / "missing.safetensors"))
