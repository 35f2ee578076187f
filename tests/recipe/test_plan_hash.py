"""The plan hash: pinned for every preset on two fixed models, recomputed from its documented
definition (docs/recipes.md, "The plan and its hash"), sensitive to every hashed field and to
nothing else, and the hashes the docs print equal what their commands compute."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shlex
from pathlib import Path

import pytest

from mxrl.arch import builtin_config, tensors_from_hf_config
from mxrl.models import build_model
from mxrl.recipe import Plan, list_presets, resolve
from tests.arch.hf_configs import QWEN3_30B_A3B
from tests.recipe.test_resolve import plan_30b

REPO = Path(__file__).resolve().parents[2]
# docs/checkpoints.md's served example: a 4-layer Qwen3-MoE of width 256, 8 experts, no shared one
TINY_MOE_256 = {**builtin_config("tiny-moe"), "hidden_size": 256, "head_dim": 64,
                "moe_intermediate_size": 128, "vocab_size": 1024}  # fmt: skip
del TINY_MOE_256["shared_expert_intermediate_size"]
CONFIGS = {"tiny-moe": builtin_config("tiny-moe"), "qwen3-30b-a3b": QWEN3_30B_A3B,
           "tiny-moe-256": TINY_MOE_256}  # fmt: skip

# Written down once from this version's resolve; a change to any of them changes the contract
# every checkpoint and every live sync is checked against: it must be deliberate (and the docs'
# printed hashes follow, test below). Backward modes share a hash (it is not in the contract).
PINNED = {
    ("tiny-moe", "per_expert"): {
        "bf16": "28fd440c5d06c4823a9e44dd5f0e8b2753cada143412735531843814bc4fa086",
        "mxfp8": "1635300f3b74e7d1307f8f33e3d4d592c6eb75f7d90ec01b0d5bffb1b9679087",
        "nvfp4": "46867b25a1678904ad8946e4f1917f3f522d13fdda0f69a815ef0de6493785a8",
        "nvfp4-4over6": "68f6751073e67d1d2fc1353addf62b33a2dc05b32963685a947018f9a95988df",
    },
    ("tiny-moe", "fused"): {
        "bf16": "cbe7c15892747932463beb36e149f640d2e2d9225e98c8f6cb2ccdec4d1a15ab",
        "mxfp8": "c5fa852fe933c046f3a35f87fe9bce78438e6b3fa6c982a3113d6831621fe9bc",
        "nvfp4": "751efb36d1d3871d82664592d8caec42af3a1c005003690d39957354614abba9",
        "nvfp4-4over6": "bafb31c44f74356f9ef05370d23733a9731e166952a866d26aee621b040266b2",
    },
    ("qwen3-30b-a3b", "per_expert"): {
        "bf16": "de1e728289589e969eaddd7cde82832baf3dcec31d9227de0b3837ef0f38d08c",
        "mxfp8": "1411f8e39037df2b1cbc896eba8b0f9ee9fefef1d8cda207f7addafadf15fe48",
        "nvfp4": "797eb5112838b97661225f151cd0224ffb82893b81b297dee6758af524c0784d",
        "fp8-block": "7aa5ff0955dfedbfb0132ccbddfe2d2655378f40883c3044d5713e532f200e7b",
        "nvfp4-4over6": "48d0280afdfc00a0966e1cb8bb9d7abc6c967551f9d378af79881e2b9b011440",
    },
    ("qwen3-30b-a3b", "fused"): {
        "bf16": "a518b43159b82bb01e7cbd7924f74acc3ecfe341f5f7963c59cc6de5da6d1d52",
        "mxfp8": "78c39803e1afeea94c14a4e1052d59d978cfc9eb70e0843e18f31c44fb086d1e",
        "nvfp4": "fc389dd69b536a2d62d0a9cad45baaaa06a2849f1084ed25555eac7bfbbf1aef",
        "fp8-block": "2059e0ce459caa4bcc983b87bc7f7a8ab32d870ef7a2085b5ef49a95066d5c7c",
        "nvfp4-4over6": "b7b1c64bce97d7e5f3c2357e0e57f7c9423b88fec6cb32dbea693e41f886fddf",
    },
}
# preset -> its contract family in PINNED
FAMILY = {
    "bf16": "bf16",
    "mxfp8": "mxfp8",
    "mxfp8-hp": "mxfp8",
    "mxfp8-dequantized": "mxfp8",
    "nvfp4-hp": "nvfp4",
    "nvfp4-dequantized": "nvfp4",
    "nvfp4-4over6-hp": "nvfp4-4over6",
    "fp8-block": "fp8-block",
    "fp8-block-quantized": "fp8-block",
}


def _plan(model: str, layout: str, preset: str) -> Plan:
    if (model, layout) == ("qwen3-30b-a3b", "per_expert"):
        return plan_30b(preset)  # cached: test_resolve resolves it too
    return resolve(preset, tensors_from_hf_config(CONFIGS[model], layout))


def _documented_hash(plan: Plan) -> str:
    """The definition written out: sha256 of canonical JSON (sorted keys, no whitespace) of the
    schema version and, per tensor sorted by name, name, shape, format, activations,
    fuse_group, block, and scale_mode where it is set (NVFP4 4over6)."""
    tensors = [
        {
            "name": s.name,
            "shape": list(s.shape),
            "format": s.format.value,
            "activations": s.activations,
            "fuse_group": s.fuse_group,
            "block": None if s.block is None else list(s.block),
            **({} if s.scale_mode is None else {"scale_mode": s.scale_mode}),
        }
        for s in sorted(plan.values(), key=lambda s: s.name)
    ]
    text = json.dumps({"schema": 1, "tensors": tensors}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def test_every_preset_has_a_pinned_family():
    assert sorted(FAMILY) == sorted(list_presets())


@pytest.mark.parametrize(("model", "layout"), list(PINNED))
def test_plan_hashes_are_pinned(model, layout):
    for preset in list_presets():
        family = FAMILY[preset]
        if family not in PINNED[model, layout]:  # the tiny model's K = 64 takes no 128 block
            with pytest.raises(ValueError, match="multiple of the fp8_block block"):
                _plan(model, layout, preset)
            continue
        plan = _plan(model, layout, preset)
        assert plan.hash() == PINNED[model, layout][family], (model, layout, preset)
        assert plan.hash() == _documented_hash(plan), (model, layout, preset)


def _swap(plan: Plan, tensor: str, **fields) -> Plan:
    specs = [dataclasses.replace(s, **fields) if s.name == tensor else s for s in plan.values()]
    return Plan(plan.recipe_name, plan.backward, plan.num_layers, tuple(specs))


WIDE = {
    **builtin_config("tiny-moe"),
    "hidden_size": 128,
    "head_dim": 32,
    "moe_intermediate_size": 128,
}
Q, EXPERTS = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.gate_up_proj"


def test_every_hashed_field_changes_the_hash():
    fp8 = resolve("fp8-block", tensors_from_hf_config(WIDE, "fused"))
    nvfp4 = resolve("nvfp4-dequantized", tensors_from_hf_config(WIDE, "fused"))
    mxfp8 = resolve("mxfp8", tensors_from_hf_config(WIDE, "fused"))
    assert fp8[Q].block == (128, 128) and nvfp4[EXPERTS].fuse_group == EXPERTS
    changed = {
        "block rows": _swap(fp8, Q, block=(64, 128)),
        "block columns": _swap(fp8, Q, block=(128, 64)),
        "format": _swap(mxfp8, Q, format="bf16"),
        "activation scale": _swap(nvfp4, EXPERTS, activations="per_tensor"),
        "block-scale rule": _swap(nvfp4, EXPERTS, scale_mode="4over6"),
        "fuse group": _swap(nvfp4, EXPERTS, fuse_group=None),
        "shape": _swap(mxfp8, Q, shape=(128, 256)),
        "name": _swap(mxfp8, Q, name="model.layers.0.self_attn.q_proj.weight2"),
    }
    base = {"block rows": fp8, "block columns": fp8, "format": mxfp8, "activation scale": nvfp4,
            "block-scale rule": nvfp4, "fuse group": nvfp4, "shape": mxfp8,
            "name": mxfp8}  # fmt: skip
    for what, plan in changed.items():
        assert plan.hash() != base[what].hash(), what
        assert plan.hash() == _documented_hash(plan), what


def test_provenance_name_and_backward_do_not_change_the_hash():
    """What decides no byte stays out: rule provenance, the recipe's name and its backward
    mode (docs/recipes.md; the three mxfp8 presets and the two nvfp4 ones share a hash)."""
    plan = resolve("mxfp8", tensors_from_hf_config(WIDE, "fused"))
    relabelled = _swap(plan, Q, rule="rules[9] {name: 'elsewhere'}")
    assert relabelled.hash() == plan.hash() and relabelled != plan
    other = Plan("renamed", "high_precision", plan.num_layers, tuple(plan.values()))
    assert other.hash() == plan.hash()


# --- the hashes the docs print ----------------------------------------------------------------

HEX = re.compile(r"\b[0-9a-f]{64}\b")
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _doc_hashes():
    """(file, line, hash, the block's last `$ mxrl ...` command, the block) for every 64-hex
    plan hash in a fenced block; a 64-hex that is no plan hash must be a record's checksum."""
    found = []
    for path in DOCS:
        for block in re.findall(r"```[a-z]*\n(.*?)```", path.read_text(), re.S):
            command = None
            for line in block.splitlines():
                if line.startswith("$ mxrl "):
                    command = line[2:]
                for h in HEX.findall(line):
                    if "plan" in line:
                        found.append((path.name, line, h, command, block))
                    else:
                        assert '"hash":' in line, f"{path.name}: unclassified 64-hex: {line}"
    return found


def _doc_model(name: str | None) -> tuple[str, dict]:
    """A documented --model argument -> a directory there holding that model's config."""
    if name is None:
        return "", CONFIGS["tiny-moe"]
    key = "qwen3-30b-a3b" if "Qwen3-30B-A3B" in name else name
    assert key in CONFIGS, f"a model the docs use but this test does not know: {name}"
    return name, CONFIGS[key]


def _computed(command: str | None, line: str, block: str, tmp: Path, capsys) -> str:
    """What the documented command prints as the plan hash (run as written, in a folder that
    holds the model it names), or, for a run's record, the plan a run of that model and recipe
    resolves (`mxrl train`: the recipe on the model's own parameters)."""
    from mxrl.cli import main
    from mxrl.models import save_pretrained

    argv = shlex.split(command, comments=True)[1:]
    if argv[:2] == ["runs", "show"]:
        recipe = re.search(r"plan: ([\w.-]+),", line).group(1)
        model = re.search(r"^\s+model: (\S+)$", block, re.M).group(1)
        assert model == "tiny-moe", model
        net = build_model(CONFIGS[model], seed=0)
        return resolve(recipe, {n: p.shape for n, p in net.named_parameters()}).hash()
    if "--model" in argv:
        i = argv.index("--model") + 1
        name, config = _doc_model(argv[i])
        where = tmp / name
        where.mkdir(parents=True, exist_ok=True)
        if argv[0] == "convert":  # a checkpoint: the tiny model's weights
            save_pretrained(build_model(config, seed=0), where)
        else:
            (where / "config.json").write_text(json.dumps(config))
        argv[i] = str(where)
    if "--out" in argv:
        argv[argv.index("--out") + 1] = str(tmp / "out")
    capsys.readouterr()
    assert main(argv) == 0, command
    printed = HEX.findall("\n".join(ln for ln in capsys.readouterr().out.splitlines()
                                    if "plan hash" in ln))  # fmt: skip
    assert len(printed) == 1, command
    return printed[0]


def test_the_hashes_printed_in_the_docs_are_what_their_commands_compute(tmp_path, capsys):
    found = _doc_hashes()
    # README and recipes.md (recipe show on Qwen3-30B-A3B), runs.md (a run's record), sync.md
    # (mxrl convert's output and the manifest it writes, twice)
    assert len(found) >= 6, [f[:2] for f in found]
    cache: dict[tuple[str, str], str] = {}
    for i, (doc, line, printed, command, block) in enumerate(found):
        assert command is not None, f"{doc}: a plan hash with no mxrl command above it: {line}"
        key = (command, line if command.startswith("mxrl runs") else "")
        if key not in cache:
            cache[key] = _computed(command, line, block, tmp_path / str(i), capsys)
        assert printed == cache[key], f"{doc}: {line.strip()!r} but `{command}` gives {cache[key]}"
