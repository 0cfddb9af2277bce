"""The task a run trains (`run.task`, `run.taskOptions`): it reaches the coordinator (which
hands it to every learner that joins) and every shard through the one run config they
read, rendered deterministically; the learners get its code from their image, in the Job
and in every pod the launcher makes; the built-in byte GPT's options are the ones the
task reads, and the defaults and presets train the model they trained before the model
settings became task options; the documentation's snippets pass the chart's own checks."""

import copy
import hashlib
import json
import re
from argparse import Namespace

import pytest
import yaml

from diloco.cli.common import build_run_config
from diloco.command import build_parser
from diloco.config import RunConfig
from diloco.task import DEFAULT_TASK, TaskContext
from diloco.tasks.byte_gpt import ModelConfig, Options
from tests.k8s.chart import CHART, EXISTING_SECRET, PRESETS, REGISTRY, ROOT, args, container, merge, mounted, preset, \
    statefulset_pod, templated_pod
from tests.k8s.conftest import CUSTOM_OPTIONS, CUSTOM_TASK, VARIANTS, coordinator_launcher
from tests.k8s.test_images import hadolint

DOCS = ROOT / "docs" / "kubernetes.md"


def run_config_of(rendered) -> str:
    return rendered.one("ConfigMap", "-run")["data"]["run-config.json"]


def readers(rendered):
    """(pod, container) of every process that reads the run config: the coordinator and each shard."""
    deployment = rendered.one("Deployment", "-coordinator")
    out = [(templated_pod(deployment["spec"]["template"], "diloco-coordinator-abc"), "coordinator")]
    sts = rendered.one("StatefulSet", "-syncer")
    out += [(statefulset_pod(sts, m), "syncer") for m in range(sts["spec"]["replicas"])]
    return out


def learner_pods(rendered, tmp_path):
    """Every learner pod the release runs: the Job's, and one launched per pool by the real launcher."""
    import asyncio

    [job] = rendered.all("Job")
    pods = {"job": templated_pod(job["spec"]["template"], "diloco-learner-0-abcde")}
    launcher, api = coordinator_launcher(rendered, tmp_path)

    async def launch():
        for i, pool in enumerate(rendered.pod_templates()):
            [result] = await launcher.launch([f"{i + 0xb0:08x}"], pool, {})
            assert result.ok, result.detail

    asyncio.run(launch())
    assert len(api.created) == len(rendered.pod_templates())
    pods.update({f"launched/{p['metadata']['labels']['diloco/pool']}": p for p in api.created})
    return pods


# --- the run config: the coordinator and every shard --------------------------------------


def test_the_task_and_its_options_reach_the_coordinator_and_every_shard(variants, tmp_path):
    rendered = variants["custom-task"]
    configmap = rendered.one("ConfigMap", "-run")
    text = run_config_of(rendered)
    (tmp_path / "run-config.json").write_text(text)
    expected = RunConfig(task=CUSTOM_TASK, task_options=CUSTOM_OPTIONS, seed=7)
    processes = readers(rendered)
    assert len(processes) == 1 + rendered.values["syncer"]["shards"]
    for pod, name in processes:
        c = container(pod, name)
        given = args(pod, c)
        parsed = build_parser().parse_args(given)
        source = mounted(pod, c, parsed.run_config)
        assert (source.kind, source.source, source.key) == ("configMap", configmap["metadata"]["name"], "run-config.json")
        # What the real command line makes of the file it names: the task, its options verbatim.
        assert build_run_config(Namespace(**{**vars(parsed), "run_config": str(tmp_path / "run-config.json")})) == expected
        # The file is the one source: no task flags beside it that it would silently override.
        assert not {"--task", "--task-option", "--seed"} & set(given), name


def test_task_options_render_sorted_whatever_order_they_are_given_in(chart, variants):
    rendered = variants["custom-task"]
    text = run_config_of(rendered)
    options = json.loads(text, object_pairs_hook=lambda pairs: pairs)
    task_options = dict(options)["task_options"]
    assert [k for k, _ in task_options] == sorted(CUSTOM_OPTIONS)
    assert [k for k, _ in options] == sorted(k for k, _ in options), "keys sorted like RunConfig.to_json"
    reordered = copy.deepcopy(VARIANTS["custom-task"])
    reordered["run"]["taskOptions"] = dict(reversed(list(CUSTOM_OPTIONS.items())))
    again = chart.render(reordered)
    assert run_config_of(again) == text
    assert again.one("Job")["metadata"]["name"] == rendered.one("Job")["metadata"]["name"]


def test_a_null_drops_an_option_a_preset_set(chart):
    values = merge(preset("values-tpu-v5e.yaml"), EXISTING_SECRET, {"run": {
        "task": CUSTOM_TASK, "taskOptions": {"width": None, "depth": None, "heads": None, "context": None,
                                             "batch_size": None, "vocab": "32000"}}})
    run = RunConfig.from_json(run_config_of(chart.render(values)))
    assert (run.task, run.task_options) == (CUSTOM_TASK, {"vocab": "32000"})
    kept = merge(preset("values-tpu-v5e.yaml"), EXISTING_SECRET, {"run": {"taskOptions": {"heads": None}}})
    assert "heads" not in RunConfig.from_json(run_config_of(chart.render(kept))).task_options


# --- the learners: the task from the coordinator, its code from their image ---------------


def test_every_learner_pod_runs_the_task_image_and_takes_the_task_from_the_coordinator(variants, tmp_path):
    rendered = variants["custom-task"]
    image = "us-docker.pkg.dev/p/r/mytask-tpu:3"
    pods = learner_pods(rendered, tmp_path)
    assert set(pods) == {"job", "launched/spot-a", "launched/spot-b", f"launched/{rendered.values['learners']['pool']}"}
    digest = hashlib.sha256(run_config_of(rendered).encode()).hexdigest()
    for where, pod in pods.items():
        c = container(pod, "learner")
        assert c["image"] == image, where
        given = args(pod, c)
        parsed = build_parser().parse_args(given)
        assert parsed.command == "learner" and parsed.coordinator, where
        # Joined learners get the run config from the coordinator; the chart passes them no
        # task flags (the CLI would ignore them) and no byte GPT shorthands.
        assert not {"--task", "--task-option", "--batch-size", "--data", "--width"} & set(given), where
        assert pod["metadata"]["annotations"]["checksum/run-config"] == digest, where
        assert parsed.num_learners == rendered.values["learners"]["replicas"], where
    for pod, name in readers(rendered):
        assert container(pod, name)["image"] == f"{REGISTRY}/diloco:0.1.0", "the coordinator and the shards need no task code"


@pytest.mark.parametrize(("name", "planned"), [("values-tpu-v6e.yaml", 8), ("static-only", 3), ("scavenged-only", 1)])
def test_tasks_are_told_how_many_learners_the_run_is_planned_for(renders, name, planned):
    """TaskContext.num_learners (a task may split its data by it) is learners.replicas, and
    at least 1 when every learner is scavenged."""
    rendered = renders[name]
    pods = [p for p in rendered.workload_pods().values() if p["metadata"]["labels"]["app.kubernetes.io/component"] == "learner"]
    pods += list(rendered.pod_templates().values()) if rendered.values["scavenging"]["enabled"] else []
    assert pods
    for pod in pods:
        assert build_parser().parse_args(args(templated_pod(pod, "p"), container(pod, "learner"))).num_learners == planned


def test_a_new_task_or_new_options_replace_the_learner_job_and_restart_the_readers(chart):
    def identity(values):
        rendered = chart.render(values)
        coordinator = rendered.one("Deployment", "-coordinator")["spec"]["template"]["metadata"]["annotations"]
        syncer = rendered.one("StatefulSet", "-syncer")["spec"]["template"]["metadata"]["annotations"]
        return rendered.one("Job")["metadata"]["name"], coordinator["checksum/config"], syncer["checksum/run-config"]

    base = identity(EXISTING_SECRET)
    assert base == identity(EXISTING_SECRET)
    for change in ({"run": {"task": CUSTOM_TASK}}, {"run": {"taskOptions": {"width": "256"}}}, {"run": {"seed": 1}}):
        changed = identity(merge(EXISTING_SECRET, change))
        assert len(base) == len(changed) > 0 and all(b != c for b, c in zip(base, changed)), change


def test_notes_name_the_task_its_options_and_where_the_learners_load_it_from(presets, variants):
    notes = variants["custom-task"].notes
    assert f"task          {CUSTOM_TASK}, seed 7" in notes
    assert "task options  " + " ".join(f"{k}={CUSTOM_OPTIONS[k]}" for k in sorted(CUSTOM_OPTIONS)) in notes
    assert "us-docker.pkg.dev/p/r/mytask-tpu:3" in notes
    default = variants["defaults"].notes
    assert f"task          {DEFAULT_TASK} (the built-in byte GPT), seed 0" in default
    assert "task options  none (the task's defaults)" in default
    assert "task options  batch_size=64 context=1024 depth=16 heads=16 width=1024" in presets["values-tpu-v5e.yaml"].notes


# --- the built-in byte GPT: its options, and the model the defaults and presets train -----

# The model and batch size each render trained while they were chart values
# (run.model.* and learners.batchSize), before they became options of the built-in task.
BEFORE = {
    "defaults": (ModelConfig(width=128, depth=2, heads=4, context=128, seed=0), 16),
    "values-cpu-dev.yaml": (ModelConfig(width=128, depth=2, heads=4, context=128, seed=0), 16),
    "values-tpu-v5e.yaml": (ModelConfig(width=1024, depth=16, heads=16, context=1024, seed=0), 64),
    "values-tpu-v6e.yaml": (ModelConfig(width=2048, depth=24, heads=16, context=2048, seed=0), 128),
}


@pytest.mark.parametrize("name", BEFORE)
def test_defaults_and_presets_train_the_model_they_trained_before(renders, name):
    run = RunConfig.from_json(run_config_of(renders[name]))
    assert run.task == DEFAULT_TASK
    opts = Options.parse(TaskContext(learner_index=0, num_learners=1, seed=run.seed, device="cpu", options=run.task_options))
    model, batch_size = BEFORE[name]
    assert (opts.model, opts.batch_size, opts.data) == (model, batch_size, None)
    if name == "defaults":
        assert run == RunConfig(), "the chart's defaults are the run config's"


class _Recording(dict):
    """Options that remember which keys the task asked for."""

    def __init__(self):
        super().__init__()
        self.asked: set[str] = set()

    def __contains__(self, key):
        self.asked.add(key)
        return super().__contains__(key)


def test_the_schema_allows_exactly_the_options_the_built_in_task_reads():
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["run"]
    assert schema["if"] == {"properties": {"task": {"const": DEFAULT_TASK}}}
    allowed = set(schema["then"]["properties"]["taskOptions"]["properties"])
    options = _Recording()
    Options.parse(TaskContext(learner_index=0, num_learners=1, seed=0, device="cpu", options=options))
    assert options.asked == allowed
    assert yaml.safe_load((CHART / "values.yaml").read_text())["run"]["task"] == DEFAULT_TASK
    assert re.search(r'define "diloco.builtinTask" -}}\n' + re.escape(DEFAULT_TASK) + r"\n",
                     (CHART / "templates" / "_helpers.tpl").read_text())


# --- docs/kubernetes.md ---------------------------------------------------------------------


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", DOCS.read_text(), re.M | re.S)


def test_the_docs_values_pass_the_schema_and_name_the_file_the_image_holds(chart):
    blocks = [yaml.safe_load(b) for b in _blocks("yaml")]
    assert blocks
    for values in blocks:
        chart.validate(merge(EXISTING_SECRET, values))
    [task_values] = [b for b in blocks if "task" in b.get("run", {})]
    [dockerfile] = _blocks("dockerfile")
    path, _, function = task_values["run"]["task"].rpartition(":")
    copies = [line.split()[-1] for line in dockerfile.splitlines() if line.startswith("COPY ")]
    assert path in copies and function == "build"
    base = next(line.split()[1] for line in dockerfile.splitlines() if line.startswith("FROM "))
    assert re.search(r"/diloco-tpu:\d", base)
    repository = task_values["learners"]["images"]["tpu"]["repository"]
    rendered = chart.render(merge(EXISTING_SECRET, task_values))
    assert container(rendered.one("Job")["spec"]["template"], "learner")["image"].startswith(repository + ":")


def test_the_docs_task_image_lints_clean_and_ends_as_the_charts_user(tmp_path):
    [dockerfile] = _blocks("dockerfile")
    path = tmp_path / "Dockerfile"
    path.write_text(dockerfile)
    assert hadolint(path) == []
    users = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("USER ")]
    assert users[-1] == "10001:10001"


@pytest.mark.parametrize("name", PRESETS)
def test_presets_keep_their_model_in_task_options_only(name):
    values = yaml.safe_load((CHART / name).read_text())
    assert "model" not in values.get("run", {}) and "batchSize" not in values.get("learners", {})
    assert all(isinstance(v, str) for v in values.get("run", {}).get("taskOptions", {}).values())


def test_docs_do_not_name_removed_values():
    text = DOCS.read_text() + (CHART / "values.yaml").read_text() + "".join(
        p.read_text() for p in sorted((CHART / "templates").rglob("*")) if p.is_file())
    for removed in ("run.model", "learners.data", "learners.batchSize", "batchSize"):
        assert removed not in text, removed
