"""values.schema.json rejects each class of bad value before anything renders (Helm
validates the merged values on install, upgrade, template and lint), naming where the
value is. The few rules a JSON schema cannot state are template checks, tested below."""

import helm_python as helm
import pytest

from tests.k8s.chart import CHART, EXISTING_SECRET, MULTIHOST_PRESETS, PRESETS, merge, preset

AUTH = EXISTING_SECRET
GOOD_RESOURCES = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "1Gi"}}

# class of bad value -> (values, the location Helm's report names)
BAD = {
    "unknown top-level key": ({"replicaCount": 3}, "additional properties 'replicaCount'"),
    "unknown nested key (a typo)": ({"syncer": {"shard": 4}}, "at '/syncer': additional properties 'shard'"),
    "wrong type": ({"syncer": {"shards": "four"}}, "/syncer/shards"),
    "below minimum": ({"syncer": {"shards": 0}}, "/syncer/shards"),
    "above maximum": ({"coordinator": {"port": 70000}}, "/coordinator/port"),
    "outside an open interval": ({"syncer": {"outerMomentum": 1.0}}, "/syncer/outerMomentum"),
    "not an even block size": ({"syncer": {"blockSize": 63}}, "/syncer/blockSize"),
    "not one of an enum": ({"learners": {"accelerator": "tpu-v5e"}}, "/learners/accelerator"),
    "unknown TPU accelerator": ({"learners": {"tpu": {"accelerator": "tpu-v9"}}}, "/learners/tpu/accelerator"),
    "TPU topology the accelerator does not have": ({"learners": {"tpu": {"topology": "2x2x1"}}},
                                                   "at '/learners/tpu/topology': value must be one of '1x1', '2x2', "
                                                   "'2x4', '4x4', '4x8', '8x8', '8x16', '16x16'"),
    "a 2-D topology on a 3-D TPU": ({"learners": {"tpu": {"accelerator": "tpu-v5p-slice", "topology": "4x4",
                                                          "chipsPerHost": 4}}}, "at '/learners/tpu/topology'"),
    "chips per host the machine types do not have": ({"learners": {"tpu": {"chipsPerHost": 2}}},
                                                     "at '/learners/tpu/chipsPerHost': value must be one of 1, 4, 8"),
    "8-chip hosts of a TPU that has only 4-chip hosts": (
        {"learners": {"tpu": {"accelerator": "tpu-v4-podslice", "topology": "2x2x2", "chipsPerHost": 8}}},
        "at '/learners/tpu/chipsPerHost': value must be 4"),
    "malformed topology": ({"learners": {"tpu": {"topology": "2by4"}}}, "/learners/tpu/topology"),
    "pool name not a DNS label": ({"scavenging": {"pools": [{"name": "Spot_Pool", "spot": True}]}}, "/scavenging/pools/0/name"),
    "no scavenging pool": ({"scavenging": {"pools": []}}, "/scavenging/pools"),
    "spot grace beyond the 30 s notice": ({"scavenging": {"terminationGracePeriodSeconds": 60}},
                                          "/scavenging/terminationGracePeriodSeconds"),
    "bad quantity": ({"syncer": {"persistence": {"size": "10 GB"}}}, "/syncer/persistence/size"),
    "resources without limits": ({"learners": {"resources": {"limits": None}}}, "at '/learners/resources': missing property 'limits'"),
    "limits without memory": ({"syncer": {"resources": {"limits": {"memory": None}}}},
                               "at '/syncer/resources/limits': missing property 'memory'"),
    "bad grace": ({"syncer": {"grace": "sometimes"}}, "/syncer/grace"),
    "bad restore": ({"restore": "yesterday"}, "/restore"),
    "snapshot url without a scheme": ({"snapshots": {"url": "bucket/run"}}, "/snapshots/url"),
    "negative snapshot retention": ({"snapshots": {"keep": -1}}, "/snapshots/keep"),
    "OTLP endpoint without a scheme": ({"otel": {"endpoint": "collector:4317"}}, "/otel/endpoint"),
    "unknown sampler": ({"otel": {"sampler": "sometimes"}}, "/otel/sampler"),
    "env var without a name": ({"otel": {"extraEnv": [{"value": "x"}]}}, "at '/otel/extraEnv/0': missing property 'name'"),
    "bad scrape interval": ({"metrics": {"interval": "often"}}, "/metrics/interval"),
    "bad image digest": ({"image": {"digest": "latest"}}, "/image/digest"),
    "bad pull policy": ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    "name override too long": ({"fullnameOverride": "x" * 41}, "/fullnameOverride"),
    "bad toleration": ({"learners": {"tolerations": [{"key": "k", "operator": "Maybe"}]}}, "/learners/tolerations/0/operator"),
    "network peer with unknown field": ({"networkPolicy": {"adminFrom": [{"podSelectr": {}}]}},
                                        "additional properties 'podSelectr'"),
    "task without ':'": ({"run": {"task": "/opt/task/mytask.py"}}, "/run/task"),
    "task with an empty function": ({"run": {"task": "mytask.py:"}}, "/run/task"),
    "task with a space": ({"run": {"task": "my task.py:build"}}, "/run/task"),
    "task option an integer": ({"run": {"task": "t.py:build", "taskOptions": {"layers": 12}}},
                               "at '/run/taskOptions/layers': got number, want null or string"),
    "task option a float": ({"run": {"task": "t.py:build", "taskOptions": {"lr": 0.1}}}, "/run/taskOptions/lr"),
    "task option a boolean": ({"run": {"task": "t.py:build", "taskOptions": {"tied": True}}}, "/run/taskOptions/tied"),
    "task option a list": ({"run": {"task": "t.py:build", "taskOptions": {"sizes": ["1", "2"]}}}, "/run/taskOptions/sizes"),
    "task option key with '='": ({"run": {"task": "t.py:build", "taskOptions": {"a=b": "1"}}}, "invalid propertyName 'a=b'"),
    "task options not a map": ({"run": {"taskOptions": ["width=128"]}}, "/run/taskOptions"),
    "the built-in GPT's width unquoted": ({"run": {"taskOptions": {"width": 256}}}, "/run/taskOptions/width"),
    "the built-in GPT's width not a number": ({"run": {"taskOptions": {"width": "wide"}}}, "/run/taskOptions/width"),
    "the built-in GPT with an unknown option (a typo)": ({"run": {"taskOptions": {"widht": "256"}}},
                                                         "at '/run/taskOptions': additional properties 'widht'"),
    "the old model block": ({"run": {"model": {"width": 128}}}, "at '/run': additional properties 'model'"),
    "the old learner batch size": ({"learners": {"batchSize": 16}}, "additional properties 'batchSize'"),
    "negative seed": ({"run": {"seed": -1}}, "/run/seed"),
    "unknown reply rule": ({"run": {"replyRule": "average"}}, "/run/replyRule"),
    "unknown delta codec": ({"learners": {"deltaCodec": "int2"}}, "/learners/deltaCodec"),
    "delta density over 1": ({"learners": {"deltaDensity": 2}}, "/learners/deltaDensity"),
    "reply density of 0": ({"syncer": {"replyDensity": 0}}, "/syncer/replyDensity"),
    "unknown reply codec": ({"syncer": {"replyCodec": "fp32"}}, "/syncer/replyCodec"),
    "validator switch not a boolean": ({"validator": {"enabled": "yes"}}, "/validator/enabled"),
    "validator interval of 0": ({"validator": {"intervalSeconds": 0}}, "/validator/intervalSeconds"),
    "validator without a step": ({"validator": {"steps": 0}}, "/validator/steps"),
    "validator agreement of 0": ({"validator": {"agreement": 0}}, "/validator/agreement"),
    "validator agreement over 1": ({"validator": {"agreement": 1.5}}, "/validator/agreement"),
    "validator value misspelt": ({"validator": {"interval": 2}}, "at '/validator': additional properties 'interval'"),
    "validator mount without a path": ({"validator": {"extraVolumeMounts": [{"name": "corpus"}]}},
                                       "at '/validator/extraVolumeMounts/0': missing property 'mountPath'"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_schema_rejects(chart, case):
    values, where = BAD[case]
    with pytest.raises(helm.HelmValuesError) as error:
        chart.render(merge(AUTH, values))
    assert where in str(error.value)


def test_schema_requires_credentials(chart):
    with pytest.raises(helm.HelmValuesError) as error:
        chart.render({})
    assert "/auth" in str(error.value)
    with pytest.raises(helm.HelmValuesError) as error:
        chart.render({"auth": {"secret": "s", "joinToken": "not-an-hmac", "adminToken": "a"}})
    assert "/auth/joinToken" in str(error.value)


@pytest.mark.parametrize("name", PRESETS + MULTIHOST_PRESETS)
def test_presets_and_the_good_values_of_the_bad_cases_pass(chart, name):
    """The cases above fail for their one bad value: the same keys with good values pass."""
    chart.validate(merge(preset(name), AUTH))
    chart.validate(merge(AUTH, {
        "syncer": {"shards": 4, "outerMomentum": 0.0, "blockSize": 32, "grace": 0.5, "persistence": {"size": "10Gi"}},
        "learners": {"tpu": {"accelerator": "tpu-v6e-slice", "topology": "2x2", "chipsPerHost": 4}, "resources": GOOD_RESOURCES,
                     "tolerations": [{"key": "k", "operator": "Exists"}]},
        "scavenging": {"pools": [{"name": "spot-pool", "spot": True}], "terminationGracePeriodSeconds": 30},
        "restore": 12, "otel": {"endpoint": "https://collector:4317", "sampler": "always_on",
                                "extraEnv": [{"name": "A", "value": "x"}]},
        "metrics": {"interval": "15s"}, "image": {"digest": "sha256:" + "0" * 64, "pullPolicy": "Always"},
        "fullnameOverride": "x" * 40, "networkPolicy": {"adminFrom": [{"podSelector": {}}]},
        "run": {"taskOptions": {"width": "256", "heads": "8", "data": "/data", "eval_batches": "4"}, "seed": 3,
                "replyRule": "mix"},
        "validator": {"enabled": True, "intervalSeconds": 0.5, "steps": 1, "agreement": 1, "resources": GOOD_RESOURCES,
                      "extraVolumeMounts": [{"name": "corpus", "mountPath": "/data"}]},
    }))
    # A task of the user's own: any option names, string values, and null drops a key.
    chart.validate(merge(AUTH, {"run": {"task": "/opt/task/mytask.py:build",
                                        "taskOptions": {"widht": "x", "optim.betas": "0.9,0.95", "width": None}}}))
    chart.validate(merge(AUTH, {"run": {"task": "mypackage.train:build_task", "taskOptions": {"a": ""}}}))


# --- what the schema cannot say: checked in the templates ---------------------------------

TEMPLATE_ERRORS = {
    "width not divisible by heads": ({"run": {"taskOptions": {"width": "130", "heads": "4"}}},
                                     "width 130 must be divisible by heads 4"),
    "width not divisible by the default heads": ({"run": {"taskOptions": {"width": "130"}}},
                                                 "width 130 must be divisible by heads 4"),
    "a pool listed twice": ({"scavenging": {"pools": [{"name": "spot"}, {"name": "spot"}]}}, 'pool "spot" is listed twice'),
    "restore without a snapshot volume": ({"restore": "latest", "snapshots": {"enabled": False}}, "restore needs snapshots.enabled"),
    "object-store credentials without a url": ({"snapshots": {"credentialsSecret": "s3"}}, "set snapshots.url too"),
    "an isolation hold shorter than a lease": (
        {"coordinator": {"isolationHoldLeases": 0.5}}, "coordinator.isolationHoldLeases 0.5 must be 0 (off) or at least 1"),
    "TPU hosts with more chips than the slice": (
        {"learners": {"tpu": {"topology": "1x1", "chipsPerHost": 4}}},
        "learners.tpu.chipsPerHost 4 does not divide the 1 chip(s) of learners.tpu.topology 1x1: "
        "set learners.tpu.chipsPerHost to 1 (one host)"),
    "a multi-host slice of 8-chip hosts": (
        {"learners": {"tpu": {"topology": "4x4", "chipsPerHost": 8}}},
        "learners.tpu.topology 4x4 (16 chips) on hosts of learners.tpu.chipsPerHost 8 would be 2 hosts, but GKE builds "
        "multi-host tpu-v5-lite-podslice slices from 4-chip hosts only: set learners.tpu.chipsPerHost to 4 (4 hosts)"),
    "a multi-host slice of 1-chip hosts": (
        {"learners": {"tpu": {"accelerator": "tpu-v6e-slice", "topology": "2x2", "chipsPerHost": 1}}},
        "would be 4 hosts, but GKE builds multi-host tpu-v6e-slice slices from 4-chip hosts only"),
    "slice pod names longer than a DNS label": (
        {"fullnameOverride": "x" * 40, "learners": {"tpu": {"topology": "4x4", "chipsPerHost": 4}}},
        # The static learners' <fullname>-learner-<hash>-<learner>-slice-0-<host>-<5 characters>.
        "would be 75 characters, more than 63: shorten the release name or set fullnameOverride"),
}


@pytest.mark.parametrize("case", TEMPLATE_ERRORS, ids=list(TEMPLATE_ERRORS))
def test_template_rejects(chart, case):
    values, message = TEMPLATE_ERRORS[case]
    with pytest.raises(helm.HelmError) as error:
        chart.render(merge(AUTH, values))
    assert message in str(error.value)


def test_schema_covers_every_default_key():
    """Every key of values.yaml is described by the schema (additionalProperties is
    false all the way down, so an undescribed key would fail validation of the defaults)."""
    chart = helm.Chart.load(CHART)
    schema = chart.schema

    def walk(values, node, path):
        node = resolve(node)
        if isinstance(values, dict) and node.get("type") == "object" and "properties" in node:
            assert node.get("additionalProperties") is False, f"{path or '/'} accepts unknown keys"
            for key, value in values.items():
                assert key in node["properties"], f"{path}/{key} is not in the schema"
                walk(value, node["properties"][key], f"{path}/{key}")

    def resolve(node):
        while "$ref" in node:
            node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
        return node

    walk(chart.values, schema, "")
