"""The policy engine: rule matching and order, the catch-all, TOML files with located errors,
the hylo preset on the bundled models, and a policy under the aggregator (one collective per
codec group, bytes per parameter)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from thinwire.algorithms.sync import SyncReducer
from thinwire.comm.local import LocalWorld
from thinwire.policy import ParamInfo, Policy, Rule
from thinwire.tasks.mnist1d import cnn
from thinwire.tasks.vision_models import vgg_small


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(8, 16, 3)  # weight 1152
        self.norm = nn.BatchNorm2d(16)
        self.emb = nn.Embedding(50, 8)  # 400
        self.head = nn.Linear(16, 40)  # weight 640


def _codecs(policy: Policy, model: nn.Module) -> dict[str, str]:
    a = policy.assign(model)
    return {name: a.codec_for(name).name for name in a.rule_of}


# -- matching -------------------------------------------------------------------------------------
def test_first_matching_rule_wins_and_the_catch_all_takes_the_rest():
    policy = Policy([
        {"module": "conv", "codec": "kernels"},
        {"name": r"^head\.weight$", "codec": "twobit"},
        {"module": "linear", "codec": "topk"},  # head.weight matched above; head.bias lands here
        {"codec": "identity"},
    ])
    assert _codecs(policy, Net()) == {
        "conv.weight": "kernels", "conv.bias": "kernels", "norm.weight": "identity", "norm.bias": "identity",
        "emb.weight": "identity", "head.weight": "twobit", "head.bias": "topk",
    }


def test_size_and_ndim_conditions_are_inclusive_bounds():
    policy = Policy([
        {"min_numel": 640, "max_numel": 640, "codec": "twobit"},
        {"ndim": [4], "codec": "kernels"},
        {"ndim": 2, "max_numel": 400, "codec": "topk"},
        {"codec": "identity"},
    ])
    got = _codecs(policy, Net())
    assert got["head.weight"] == "twobit" and got["conv.weight"] == "kernels" and got["emb.weight"] == "topk"
    assert got["conv.bias"] == got["head.bias"] == "identity"


def test_module_types_by_group_class_name_and_class():
    net = Net()
    for module in ("norm", "BatchNorm2d", nn.BatchNorm2d, ["Embedding", nn.BatchNorm2d]):
        got = _codecs(Policy([Rule("topk", module=module), Rule("identity")]), net)
        assert got["norm.weight"] == "topk" and got["conv.weight"] == "identity"
    got = _codecs(Policy([Rule("topk", module="embedding"), Rule("identity")]), net)
    assert got["emb.weight"] == "topk" and got["norm.weight"] == "identity"


def test_rule_order_matters():
    a = Policy([{"module": "linear", "codec": "topk"}, {"ndim": 2, "codec": "twobit"}, {"codec": "identity"}])
    b = Policy([{"ndim": 2, "codec": "twobit"}, {"module": "linear", "codec": "topk"}, {"codec": "identity"}])
    assert _codecs(a, Net())["head.weight"] == "topk" and _codecs(b, Net())["head.weight"] == "twobit"


def test_each_rule_builds_one_codec_shared_by_its_parameters():
    a = Policy([{"module": "linear", "codec": "topk"}, {"codec": "identity"}]).assign(Net())
    assert a.codec_for("head.weight") is a.codec_for("head.bias") is a.codecs[0]


def test_module_rules_need_the_model():
    policy = Policy([{"module": "conv", "codec": "kernels"}, {"codec": "identity"}])
    with pytest.raises(ValueError, match="matches by module type"):
        policy.assign(list(Net().named_parameters()))
    names_only = Policy([{"name": "weight$", "codec": "topk"}, {"codec": "identity"}])
    assert names_only.assign(list(Net().named_parameters())).codec_for("conv.weight").name == "topk"


BAD_RULES = [
    ([], "at least one rule"),
    ([{"module": "conv", "codec": "kernels"}], "rule 1: the last rule must be a catch-all"),
    ([{"codec": "identity"}, {"module": "conv", "codec": "kernels"}],
     "rule 1: a catch-all rule (no conditions) must be the last"),
    ([{"module": "Convv", "codec": "kernels"}, {"codec": "identity"}], "rule 1: unknown module type 'Convv'"),
    ([{"module": "Module", "codec": "x"}, {"codec": "identity"}], "rule 1: unknown codec 'x'"),
    ([{"name": "conv[", "codec": "topk"}, {"codec": "identity"}],
     "rule 1: name 'conv[' is not a valid regular expression"),
    ([{"min_numel": 10, "max_numel": 5, "codec": "topk"}, {"codec": "identity"}],
     "rule 1: min_numel must be <= max_numel"),
    ([{"min_numel": -1, "codec": "topk"}, {"codec": "identity"}], "rule 1: min_numel must be an integer >= 0"),
    ([{"ndim": [-1], "codec": "topk"}, {"codec": "identity"}], "rule 1: ndim must be integers >= 0"),
    ([{"size": 3, "codec": "topk"}, {"codec": "identity"}], "rule 1: unknown key 'size'"),
    ([{"module": "conv"}, {"codec": "identity"}], "rule 1: a rule needs a codec"),
    ([{"module": "conv", "codec": "twobit:alpha=0"}, {"codec": "identity"}], "rule 1: alpha must be > 0, got 0"),
    ([{"codec": "topk"}, {"codec": "kernels:r_min=0.5,r_max=0.2"}], "rule 2: r_min must be <= r_max"),
]


@pytest.mark.parametrize("rules, message", BAD_RULES)
def test_bad_rules_name_the_rule_broken(rules, message):
    with pytest.raises(ValueError) as e:
        Policy(rules)
    assert message in str(e.value) and "\n" not in str(e.value)


# -- TOML -----------------------------------------------------------------------------------------
GOOD_TOML = """\
# conv weights as kernels, big linear weights as 2-bit codes, the rest fp32
[[rule]]
module = "conv"
ndim = [3, 4]
min_numel = 1000
codec = "kernels:r_max=0.5"

[[rule]]
module = ["linear"]
name = "weight$"
codec = "twobit:alpha=1.5"

[[rule]]
codec = "identity"
"""


def test_toml_file_gives_the_same_rules_as_the_api(tmp_path):
    path = tmp_path / "policy.toml"
    path.write_text(GOOD_TOML)
    policy = Policy.from_toml(path)
    api = Policy([
        Rule("kernels:r_max=0.5", module="conv", ndim=(3, 4), min_numel=1000),
        Rule("twobit:alpha=1.5", module="linear", name="weight$"),
        Rule("identity"),
    ])
    assert policy.rules == api.rules
    assert _codecs(policy, Net()) == {"conv.weight": "kernels", "conv.bias": "identity", "norm.weight": "identity",
                                      "norm.bias": "identity", "emb.weight": "identity", "head.weight": "twobit",
                                      "head.bias": "identity"}
    assert Policy(policy.to_dicts()).rules == policy.rules


@pytest.mark.parametrize(
    "change, message",
    [
        (('module = ["linear"]', 'module = ["Lineer"]'), "policy.toml:8: rule 2: unknown module type 'Lineer'"),
        (('name = "weight$"', 'name = "weight("'),
         "policy.toml:8: rule 2: name 'weight(' is not a valid regular expression"),
        (('codec = "identity"', 'codec = "identity"\nname = "x"'),
         "policy.toml:13: rule 3: the last rule must be a catch-all"),
        (('min_numel = 1000', 'min_numel = 1000\nmax_numel = 10'),
         "policy.toml:2: rule 1: min_numel must be <= max_numel"),
        (('ndim = [3, 4]', 'dims = [3, 4]'), "policy.toml:2: rule 1: unknown key 'dims'"),
        (('codec = "kernels:r_max=0.5"', 'codec = "kernels:r_max=2"'),
         "policy.toml:2: rule 1: r_max must be in (0, 1], got 2"),
        (('[[rule]]\nmodule = "conv"', 'mode = 1\n[[rule]]\nmodule = "conv"'), "unknown top-level key 'mode'"),
        (('min_numel = 1000', 'min_numel = = 1000'), "policy.toml: not valid TOML"),
    ],
)
def test_bad_toml_names_the_file_line_and_rule(tmp_path, change, message):
    path = tmp_path / "policy.toml"
    path.write_text(GOOD_TOML.replace(*change, 1))
    with pytest.raises(ValueError) as e:
        Policy.from_toml(path)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_missing_or_empty_policy_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read policy file"):
        Policy.from_toml(tmp_path / "none.toml")
    (tmp_path / "empty.toml").write_text("# nothing\n")
    with pytest.raises(ValueError, match="no \\[\\[rule\\]\\] tables"):
        Policy.from_toml(tmp_path / "empty.toml")


# -- the hylo preset ------------------------------------------------------------------------------
def test_hylo_on_the_mnist1d_cnn():
    got = _codecs(Policy.preset("hylo"), cnn())
    assert {n for n, c in got.items() if c == "kernels"} == {"conv2.weight", "conv3.weight"}  # 20480 > 16384
    assert {n for n, c in got.items() if c == "twobit"} == {"fc1.weight"}  # 163840 > 65536
    assert {n for n, c in got.items() if c == "identity"} == {
        "conv1.weight", "conv1.bias", "conv2.bias", "conv3.bias", "fc1.bias", "fc2.weight", "fc2.bias"}


def test_hylo_on_the_small_vgg():
    got = _codecs(Policy.preset("hylo"), vgg_small())
    kernels = {n for n, c in got.items() if c == "kernels"}
    assert kernels == {f"features.{i}.weight" for i in (7, 10, 14, 17)}  # 18432 .. 147456; features.3 is 9216
    assert {n for n, c in got.items() if c == "twobit"} == {"fc1.weight"}  # 524288; fc2 is 2560
    assert all(c == "identity" for n, c in got.items() if n not in kernels and n != "fc1.weight")


def test_hylo_knobs_pass_through_to_its_codecs():
    policy = Policy.preset("hylo:t_fc=100000,alpha=1.5,granularity=filter,r_max=0.5")
    a = policy.assign(cnn())
    assert a.codec_for("fc1.weight").config.alpha == 1.5
    assert (a.codec_for("conv2.weight").config.granularity == "filter"
            and a.codec_for("conv2.weight").config.r_max == 0.5)
    assert a.codec_for("conv2.weight").config.t_conv == 16384
    assert _codecs(Policy.preset("hylo:t_fc=200000,t_conv=30000"), cnn())["fc1.weight"] == "identity"
    assert _codecs(Policy.preset("hylo:t_fc=200000,t_conv=30000"), cnn())["conv2.weight"] == "identity"
    assert Policy.preset(policy.describe()).rules == policy.rules  # describe() rebuilds it


@pytest.mark.parametrize(
    "spec, message",
    [
        ("hylo:alpha=0", "alpha must be > 0, got 0"),
        ("hylo:r_min=0.5,r_max=0.2", "r_min must be <= r_max"),
        ("hylo:r_max=1.5", "r_max must be in (0, 1]"),
        ("hylo:t_fc=-1", "t_fc must be >= 0"),
        ("hylo:speed=2", "unknown knob 'speed' for hylo"),
        ("hylo:stat=median", "stat must be one of mean|rms|max"),
    ],
)
def test_hylo_bad_knobs(spec, message):
    with pytest.raises(ValueError) as e:
        Policy.preset(spec)
    assert message in str(e.value)


# -- under the aggregator ---------------------------------------------------------------------
def test_hylo_sends_one_collective_per_codec_group_and_counts_bytes_per_parameter():
    """mnist1d CNN, 2 ranks, 3 steps: per step one all_gather for the kernels group, one for
    the twobit group and one all_reduce for everything fp32; the per-parameter bytes add up to
    what the meter counted, and every rank assigns the same codecs."""

    def fn(comm):
        torch.manual_seed(comm.rank)
        model = cnn()
        reducer = SyncReducer(model, "hylo", comm)
        x, y = torch.randn(16, 1, 40), torch.randint(0, 10, (16,))
        for _ in range(3):
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            reducer.reduce()
        return reducer.assignment.table(), comm.meter.snapshot(), reducer.per_parameter(), reducer.report()

    results = LocalWorld(2).run(fn)
    tables = [r[0] for r in results]
    assert tables[0] == tables[1]
    meter, rows, report = results[0][1], results[0][2], results[0][3]
    assert meter["all_gather"]["calls"] == 2 * 3 and meter["all_reduce"]["calls"] == 3
    assert sum(r["bytes_sent"] for r in rows) == pytest.approx(sum(op["bytes"] for op in meter.values()), rel=1e-12)
    by_name = {r["name"]: r for r in rows}
    # twobit on fc1 (163840 values): 4 + 4 * ceil(163840 / 16) bytes per step, gathered from 1 peer
    assert by_name["fc1.weight"]["bytes_sent"] == 3 * (4 + 4 * 10240)
    assert by_name["fc1.weight"]["codec"].startswith("twobit:")
    assert report["policy"][-1] == {"codec": "identity"} and report["codec"].startswith("hylo:")


def test_param_info_numel():
    assert ParamInfo("w", torch.Size([3, 4]), None).numel == 12


def test_the_example_policy_file_parses_and_assigns():
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "policy.toml"
    got = _codecs(Policy.from_toml(path), cnn())
    assert {n for n, c in got.items() if c != "identity"} == {"conv2.weight", "conv3.weight", "fc1.weight"}
    assert got["fc1.weight"] == "twobit" and got["conv2.weight"] == "kernels"
