"""`cuda-agent rl launch STAGE`: a stage recipe composed with verl's own Hydra config, checked,
written down and submitted to a Ray cluster.

    recipes/STAGE/config.yaml (its `base:` recipe first)
    -> Hydra overrides; "{model}", "{data}", ... filled from the command line; the
       `cuda_agent:` section as `+cuda_agent.KEY=VALUE` (defaults: `rl.settings.RLSettings`)
    -> composed with verl's trainer config (ppo_trainer, or sft_trainer_engine for RFT),
       then checked by verl's validators and RLSettings
    -> OUT/config.yaml (resolved), OUT/overrides.txt, OUT/command.sh
    -> `ray job submit ... -- python3 -m verl.trainer.main_ppo OVERRIDES` (RFT: torchrun with
       verl.trainer.sft_trainer), printed with --dry-run, run otherwise

The training resource pool is trainer.nnodes x trainer.n_gpus_per_node. Kernels are
evaluated elsewhere: on `--eval-gpus` GPUs of evaluation nodes that hold the custom Ray
resource `cuda_agent.eval_pool.resource` (and no Ray GPUs, so verl never places training
workers there). Every path in the command must exist on every node (a shared file system
and the same installation of verl and cuda-agent).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.resources
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

RECIPES_ENV = "CUDA_AGENT_RECIPES"
VERL_VERSION = "0.9.1"
RECIPE_FILE = "config.yaml"
OUT_FILES = ("config.yaml", "overrides.txt", "command.sh")
DEFAULT_RAY_ADDRESS = "http://127.0.0.1:8265"
RAY_HEAD_PORT = 6379
# a recipe's entry: the verl Hydra config it composes with (and the program it runs)
ENTRIES = {"ppo": "ppo_trainer", "sft": "sft_trainer_engine"}
PPO_MODULE = "verl.trainer.main_ppo"
SFT_MODULE = "verl.trainer.sft_trainer"
AGENT_LOOP_KEY = "actor_rollout_ref.rollout.agent.default_agent_loop"
RUNTIME_ENV = {"env_vars": {"HYDRA_FULL_ERROR": "1", "PYTHONUNBUFFERED": "1"}}
# "{name}" in a recipe value: filled in at launch (a "${...}" is Hydra's own interpolation)
_PLACEHOLDER = re.compile(r"(?<!\$)\{([a-z_]+)\}")
_PLAIN_VALUE = re.compile(r"[A-Za-z0-9_/][A-Za-z0-9_./:+-]*")


@dataclass
class Recipe:
    name: str
    folder: Path
    description: str
    entry: str  # a key of ENTRIES
    inputs: dict[str, str] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)
    cuda_agent: dict[str, Any] = field(default_factory=dict)


@dataclass
class Launch:
    """What `resolve` made of a recipe and the command line."""

    recipe: Recipe
    config: Any  # the composed omegaconf.DictConfig, interpolations unresolved
    overrides: list[str]
    command: list[str]
    nodes: int
    gpus_per_node: int
    eval_gpus: int
    ray_address: str
    out: Path
    agent_loop: str | None  # verl's default agent loop (None: the SFT stage)
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- recipes


def recipes_root() -> Path:
    """`$CUDA_AGENT_RECIPES`, else the `recipes/` folder of this source checkout."""
    env = os.environ.get(RECIPES_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[3] / "recipes"


def stage_names(root: Path | None = None) -> list[str]:
    root = root or recipes_root()
    return sorted(p.parent.name for p in root.glob(f"*/{RECIPE_FILE}"))


def load_recipe(stage: str) -> Recipe:
    """A stage by name (a folder of `recipes_root()`) or by path (a recipe folder or file)."""
    path = Path(stage)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        file = path
    elif os.sep in stage or path.is_dir():
        file = path / RECIPE_FILE
        if not file.is_file():
            raise ValueError(f"{stage} holds no {RECIPE_FILE}")
    else:
        file = recipes_root() / stage / RECIPE_FILE
        if not file.is_file():
            known = ", ".join(stage_names()) or f"none in {recipes_root()}"
            raise ValueError(f"no stage {stage!r}; the stages are {known}")
    return _load(file.resolve(), seen=())


def _load(file: Path, seen: tuple[Path, ...]) -> Recipe:
    import yaml

    if file in seen:
        raise ValueError(f"the recipe {file} is its own base")
    if not file.is_file():
        raise ValueError(f"the base recipe {file.parent.name!r} of {seen[-1]} does not exist")
    try:
        raw = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{file} is not valid YAML: {' '.join(str(exc).split())}") from exc
    known = {"description", "entry", "base", "inputs", "overrides", "cuda_agent"}
    if not isinstance(raw, dict) or set(raw) - known:
        extra = sorted(set(raw) - known) if isinstance(raw, dict) else ["(not a mapping)"]
        raise ValueError(f"{file}: unknown recipe key(s) {', '.join(extra)}; "
                         f"a recipe takes {', '.join(sorted(known))}")
    name = file.parent.name
    if raw.get("base"):
        base = _load((file.parent.parent / str(raw["base"]) / RECIPE_FILE).resolve(), (*seen, file))
    else:
        base = Recipe(name=name, folder=file.parent, description="", entry="")
    entry = str(raw.get("entry") or base.entry)
    if entry not in ENTRIES:
        raise ValueError(f"{file}: entry must be one of {', '.join(ENTRIES)}, not {entry!r}")
    return Recipe(name=name, folder=file.parent,
                  description=str(raw.get("description") or base.description), entry=entry,
                  inputs={**base.inputs, **(raw.get("inputs") or {})},
                  overrides={**base.overrides, **(raw.get("overrides") or {})},
                  cuda_agent=_deep_merge(base.cuda_agent, raw.get("cuda_agent") or {}))


def _deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# --------------------------------------------------------------------------- overrides


def hydra_value(value: Any) -> str:
    """A value in Hydra's override grammar (strings quoted where they must be)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _PLAIN_VALUE.fullmatch(text) or re.fullmatch(r"\$\{[^'\\]+\}", text):
        return text
    # Hydra: a backslash is literal unless backslashes run into a quote (or the closing one)
    text = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    text = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, text)
    return f"'{text}'"


def _flatten(prefix: str, section: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in section.items():
        if isinstance(v, dict) and v:
            flat.update(_flatten(f"{prefix}.{k}", v))
        else:
            flat[f"{prefix}.{k}"] = v
    return flat


def _fill(value: Any, values: dict[str, str | None], recipe: Recipe, used: set[str]) -> Any:
    if isinstance(value, list):
        return [_fill(v, values, recipe, used) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in values:
            raise ValueError(f"the {recipe.name} recipe uses an unknown placeholder {{{name}}}; "
                             f"known: {', '.join(sorted(values))}")
        if values[name] is None:
            raise ValueError(f"{recipe.name} needs --{name}: "
                             f"{recipe.inputs.get(name, 'see its config.yaml')}")
        used.add(name)
        return str(values[name])

    return _PLACEHOLDER.sub(one, value)


def _merge_extra(ours: dict[str, str], extra: Sequence[str]) -> list[str]:
    """Our overrides (key -> override) with the user's: a user's key replaces ours in place
    (keeping our `+` when the key is one we add), a new key comes last."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    try:
        parsed = parser.parse_overrides(list(extra))
    except HydraException as exc:
        raise ValueError(f"bad override: {_one_line(exc)}") from exc
    merged = dict(ours)
    for o in parsed:
        key = o.key_or_group + (f"@{o.package}" if o.package else "")
        mine = merged.get(key)
        line = o.input_line or ""
        if mine is not None and o.type == OverrideType.CHANGE and mine.startswith("+"):
            line = mine[: len(mine) - len(mine.lstrip("+"))] + line
        elif mine is not None and o.type == OverrideType.DEL and mine.startswith("+"):
            merged.pop(key)
            continue
        merged[key] = line
    return list(merged.values())


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _one_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and "hydra.cc/docs" not in ln]
    return " ".join(lines) or type(exc).__name__


# --------------------------------------------------------------------------- composition


def verl_config_dir() -> Path:
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"verl is not installed; the recipes are written for verl {VERL_VERSION} "
                         f"(pip install verl=={VERL_VERSION})")
    return Path(list(spec.submodule_search_locations)[0]) / "trainer" / "config"


def agent_loops_path() -> str:
    """The installed `cuda_agent/rl/agent_loops.yaml` (verl's agent-loop registry entry)."""
    return str(importlib.resources.files("cuda_agent.rl") / "agent_loops.yaml")


def reward_function_path() -> str:
    """The installed file of `cuda_agent.rl.reward` (where it would be, if not there yet)."""
    spec = importlib.util.find_spec("cuda_agent.rl.reward")
    if spec is not None and spec.origin:
        return spec.origin
    return str(Path(__file__).with_name("reward.py"))


def compose_config(entry: str, overrides: Sequence[str], stage: str = "") -> Any:
    """verl's Hydra config for `entry` with `overrides` applied (Hydra's compose API)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    where = f"{stage}: " if stage else ""
    with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
        try:
            cfg = compose(config_name=ENTRIES[entry], overrides=list(overrides))
            OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
        except (HydraException, OmegaConfBaseException) as exc:
            raise ValueError(f"{where}{_one_line(exc)}") from exc
    return cfg


def check_config(entry: str, cfg: Any, stage: str = "") -> None:
    """verl's own checks of the composed config (the model itself is not loaded), and
    RLSettings' of our `cuda_agent` section."""
    from omegaconf import OmegaConf

    where = f"{stage}: " if stage else ""
    try:
        from verl.utils.config import omega_conf_to_dataclass, validate_config
    except ImportError as exc:
        raise ValueError(f"verl cannot be imported here ({exc}); install verl=={VERL_VERSION} "
                         "with its dependencies") from exc
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            if entry == "ppo":
                probe = copy.deepcopy(cfg)
                OmegaConf.set_struct(probe, False)
                probe.critic.model = None  # its dataclass would load the model's files
                # as verl.trainer.ppo.utils.need_critic / need_reference_policy decide (that
                # module takes seconds to import)
                critic = probe.critic.enable
                use_critic = bool(critic) if critic is not None else probe.algorithm.adv_estimator == "gae"
                use_ref = bool(probe.algorithm.get("use_kl_in_reward", False)
                               or probe.actor_rollout_ref.actor.use_kl_loss)
                validate_config(probe, use_reference_policy=use_ref, use_critic=use_critic)
                omega_conf_to_dataclass(cfg.algorithm)
                omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
            else:
                for section in ("engine", "optim", "checkpoint"):
                    omega_conf_to_dataclass(cfg[section])
    except Exception as exc:  # verl's checks raise ValueError, AssertionError, Hydra's errors
        raise ValueError(f"{where}the config fails verl's checks: {_one_line(exc)}") from exc
    if entry == "ppo":
        from cuda_agent.rl.settings import RLSettings

        RLSettings.from_mapping(cfg.get("cuda_agent"))


# --------------------------------------------------------------------------- resolve


def resolve(stage: str, *, model: str, nodes: int, gpus_per_node: int,
            eval_gpus: int | None = None, data: str = "data", critic: str | None = None,
            out: str | None = None, ray_address: str | None = None,
            extra: Sequence[str] = (), check: bool = True) -> Launch:
    """The composed config, its overrides and the command that runs it."""
    recipe = load_recipe(stage)
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError("--nodes and --gpus-per-node must be at least 1")
    if eval_gpus is not None and eval_gpus < 0:
        raise ValueError("--eval-gpus must be 0 or more")
    out_dir = Path(out or Path("runs") / "rl" / recipe.name).resolve()
    values: dict[str, str | None] = {
        "model": _local_or_remote(model), "critic": _local_or_remote(critic) if critic else None,
        "data": str(Path(data).resolve()), "out": str(out_dir), "stage": recipe.name,
        "agent_loops": agent_loops_path(), "reward_function": reward_function_path()}
    used: set[str] = set()
    ours: dict[str, str] = {}
    for key, value in recipe.overrides.items():
        line = f"{key}={hydra_value(_fill(value, values, recipe, used))}"
        ours[_key(line)] = line
    if critic and "critic" not in used:
        raise ValueError(f"{recipe.name} does not take --critic: "
                         f"{recipe.inputs.get('critic', 'it trains no critic')}")
    ours["trainer.nnodes"] = f"trainer.nnodes={nodes}"
    ours["trainer.n_gpus_per_node"] = f"trainer.n_gpus_per_node={gpus_per_node}"
    if recipe.entry == "ppo":
        from cuda_agent.rl.settings import RLSettings

        section = _deep_merge(asdict(RLSettings()), recipe.cuda_agent)
        if eval_gpus:
            section = _deep_merge(section, {"eval_pool": {"ray": True, "workers": eval_gpus}})
        for key, value in _flatten("cuda_agent", section).items():
            ours[key] = f"+{key}={hydra_value(value)}"
    elif eval_gpus:
        raise ValueError(f"{recipe.name} evaluates no kernels: drop --eval-gpus")
    overrides = _merge_extra(ours, extra)
    named = [o.split("=", 1)[1] for o in overrides if _key(o) == AGENT_LOOP_KEY]
    if recipe.entry == "ppo" and named and named[-1] == "cuda_agent" and eval_gpus is None:
        raise ValueError(
            f"{recipe.name} evaluates kernels in its episodes: give the evaluation GPUs, outside "
            "the training pool, with --eval-gpus E (0: on the GPUs the episodes' workers see)")
    cfg = compose_config(recipe.entry, overrides, recipe.name)
    agent_loop = None
    if recipe.entry == "ppo":
        agent_loop = str(cfg.actor_rollout_ref.rollout.agent.default_agent_loop)
    if check:
        check_config(recipe.entry, cfg, recipe.name)
    address = _ray_address(ray_address)
    launch = Launch(recipe=recipe, config=cfg, overrides=overrides,
                    command=_command(recipe.entry, overrides, nodes, gpus_per_node, address),
                    nodes=nodes, gpus_per_node=gpus_per_node, eval_gpus=eval_gpus or 0,
                    ray_address=address, out=out_dir, agent_loop=agent_loop)
    launch.notes = _notes(launch)
    return launch


def _local_or_remote(path: str) -> str:
    """An existing local path made absolute; anything else (a hub id, a path on the cluster)
    as given."""
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else path


def _ray_address(address: str | None) -> str:
    address = address or os.environ.get("RAY_ADDRESS") or DEFAULT_RAY_ADDRESS
    if "://" not in address:
        address = f"http://{address}"
    parts = urlsplit(address)
    if parts.scheme in ("http", "https") and parts.port is None:
        address = f"{parts.scheme}://{parts.hostname}:8265{parts.path}"
    return address


def head_host(address: str) -> str:
    return urlsplit(address).hostname or "HEAD"


def _command(entry: str, overrides: list[str], nodes: int, gpus: int, address: str) -> list[str]:
    submit = ["ray", "job", "submit", "--address", address,
              "--runtime-env-json", json.dumps(RUNTIME_ENV), "--no-wait"]
    if entry == "ppo":
        return [*submit, "--", "python3", "-m", PPO_MODULE, *overrides]
    torchrun = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={gpus}"]
    if nodes == 1:
        # the entry point reserves the node's GPUs, so Ray starts it on a training node
        return [*submit, "--entrypoint-num-gpus", str(gpus), "--", *torchrun, "--standalone",
                "-m", SFT_MODULE, *overrides]
    # one torchrun per node, each run by hand with its rank (a Ray job runs on one node)
    return [*torchrun, "--node-rank=$NODE_RANK", "--master-addr=$MASTER_ADDR",
            "--master-port=29500", "-m", SFT_MODULE, *overrides]


def shell_join(command: Sequence[str]) -> str:
    """The command for a shell: quoted, except that "$VAR" stays a variable."""
    return " ".join(f'"{part}"' if re.fullmatch(r"[\w=.-]*\$[A-Z_]+", part) else shlex.quote(part)
                    for part in command)


def _notes(launch: Launch) -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    notes = []
    try:
        found = version("verl")
    except PackageNotFoundError:
        found = "unknown"
    if found != VERL_VERSION:
        notes.append(f"the recipes are written for verl {VERL_VERSION}; this is verl {found}")
    cfg = launch.config
    files = [cfg.data.get("train_files"), cfg.data.get("val_files")]
    for f in files:
        if isinstance(f, str) and f.startswith("/") and not Path(f).exists():
            notes.append(f"{f} is not on this machine; it must be on every node of the cluster")
    return notes


# --------------------------------------------------------------------------- output


def write(launch: Launch) -> list[Path]:
    """OUT/config.yaml (the composed config, resolved), OUT/overrides.txt, OUT/command.sh."""
    from omegaconf import OmegaConf

    from cuda_agent.files import atomic_write

    out = launch.out
    header = (f"# {launch.recipe.name}: verl's {ENTRIES[launch.recipe.entry]} with "
              f"overrides.txt applied (written by cuda-agent rl launch)\n")
    paths = [atomic_write(out / OUT_FILES[0], header + OmegaConf.to_yaml(launch.config, resolve=True)),
             atomic_write(out / OUT_FILES[1], "\n".join(launch.overrides) + "\n")]
    script = "#!/usr/bin/env bash\nset -euo pipefail\n"
    if launch.recipe.entry == "sft" and launch.nodes > 1:
        script += (': "${MASTER_ADDR:?the address of the node of rank 0}"\n'
                   f': "${{NODE_RANK:?the rank of this node, 0 to {launch.nodes - 1}}}"\n')
    paths.append(atomic_write(out / OUT_FILES[2], script + shell_join(launch.command) + "\n", 0o755))
    return paths


def report(launch: Launch, written: list[Path]) -> str:
    """What a person needs to start the cluster and the job."""
    r = launch.recipe
    lines = [f"{r.name}: {r.description}", *(f"  {k}: {v}" for k, v in r.inputs.items())]
    lines.append(f"training: {launch.nodes} node(s) x {launch.gpus_per_node} GPUs = "
                 f"{launch.nodes * launch.gpus_per_node} GPUs (verl's resource pool, "
                 "trainer.nnodes x trainer.n_gpus_per_node)")
    lines += _evaluation_lines(launch)
    lines.append("wrote " + ", ".join(str(p) for p in written))
    if r.entry == "sft" and launch.nodes > 1:
        lines.append(f"run on each of the {launch.nodes} training nodes (a Ray job runs on one node; "
                     f"no Ray needed), with MASTER_ADDR = the rank-0 node and NODE_RANK = "
                     f"0..{launch.nodes - 1}:")
        lines.append(f"  bash {launch.out / OUT_FILES[2]}    # which runs:")
    else:
        lines += _cluster_lines(launch)
        lines.append("submit:")
    lines.append("  " + shell_join(launch.command))
    lines += [f"note: {n}" for n in launch.notes]
    return "\n".join(lines)


def _cluster_lines(launch: Launch) -> list[str]:
    host = head_host(launch.ray_address)
    lines = ["start the cluster (every node with the same verl and cuda-agent installation, and "
             "the data, the models and the output folder on a shared file system):",
             f"  head:             ray start --head --port={RAY_HEAD_PORT} --dashboard-host=0.0.0.0",
             f"  training nodes:   ray start --address={host}:{RAY_HEAD_PORT} "
             f"--num-gpus={launch.gpus_per_node}"]
    if launch.eval_gpus:
        resource = launch.config.cuda_agent.eval_pool.resource
        lines.append(f"  evaluation nodes: ray start --address={host}:{RAY_HEAD_PORT} --num-gpus=0 "
                     f"--resources='{{\"{resource}\": G}}'   (G: that node's GPUs; "
                     f"{launch.eval_gpus} in all)")
    return lines


def _evaluation_lines(launch: Launch) -> list[str]:
    if launch.recipe.entry != "ppo":
        return []
    pool = launch.config.cuda_agent.eval_pool
    if launch.agent_loop != "cuda_agent":
        if launch.eval_gpus:
            return [f"kernels: scored by reward.custom_reward_function, which sends them to {launch.eval_gpus} "
                    f"GPUs on evaluation nodes, NOT the training GPUs (Ray resource {pool.resource})"]
        return ["kernels: scored by reward.custom_reward_function in verl's reward workers "
                "(reward.num_workers, spread over all nodes), each on the GPU of its node; give "
                "evaluation nodes with --eval-gpus E"]
    if not launch.eval_gpus:
        return ["kernels: evaluated inside the agent-loop workers, on the GPUs they see (the "
                "training nodes'); give evaluation nodes with --eval-gpus E"]
    return [f"evaluation: {launch.eval_gpus} GPUs on evaluation nodes, which are NOT the training "
            f"GPUs (cuda_agent.eval_pool: ray, {pool.workers} workers on the Ray resource "
            f"{pool.resource}; the nodes hold no Ray GPUs, so verl places no training there)"]


# --------------------------------------------------------------------------- command line


def cmd_launch(args: argparse.Namespace) -> int:
    launch = resolve(args.stage, model=args.model, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                     eval_gpus=args.eval_gpus, data=args.data, critic=args.critic, out=args.out,
                     ray_address=args.ray_address, extra=args.overrides)
    written = write(launch)
    print(report(launch, written), flush=True)
    if args.dry_run:
        return 0
    if launch.recipe.entry == "sft" and launch.nodes > 1:
        raise ValueError(f"multi-node RFT is one torchrun per node, not one Ray job: run "
                         f"{launch.out / OUT_FILES[2]} on each node as printed above")
    if shutil.which(launch.command[0]) is None:
        raise ValueError(f"the {launch.command[0]!r} executable is not on PATH: install Ray "
                         "(pip install 'ray[default]') or run with --dry-run and submit by hand")
    return subprocess.run(launch.command, check=False).returncode


class _IntermixedParser(argparse.ArgumentParser):
    """Overrides may come before, between or after the options (plain argparse stops taking
    positionals once an option has followed the first of them)."""

    _inside = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self._inside:  # parse_known_intermixed_args calls back here
            return super().parse_known_args(args, namespace)
        self._inside = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inside = False


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "launch", help="compose a stage recipe with verl's config and submit it to Ray",
        description="Compose a stage recipe (recipes/STAGE/config.yaml) with verl's Hydra config, "
                    "write it to --out and submit it with `ray job submit` (or print it with "
                    "--dry-run). Extra KEY=VALUE arguments are Hydra overrides, applied last.")
    p.add_argument("stage", help="a stage (a folder of recipes/, e.g. stage4_agentic_ppo) or a "
                                 "recipe folder or file")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides (key=value)")
    p.add_argument("--model", required=True, help="the actor (and default critic) model")
    p.add_argument("--nodes", type=int, required=True, help="training nodes")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs per training node")
    p.add_argument("--eval-gpus", type=int, default=None,
                   help="GPUs for kernel evaluation on separate evaluation nodes (not the "
                        "training GPUs); 0: evaluate where the episodes run. Needed by PPO stages")
    p.add_argument("--critic", help="the critic to start from (stage 4: stage 3's)")
    p.add_argument("--data", default="data", help="the folder of `cuda-agent rl prepare` "
                                                  "(single_turn/, agentic/) and rft/ (default: data)")
    p.add_argument("--out", help="folder for the config, the command and the checkpoints "
                                 "(default: runs/rl/STAGE)")
    p.add_argument("--ray-address", help="the Ray dashboard of the head, e.g. http://HEAD:8265 "
                                         "(default: $RAY_ADDRESS, else local)")
    p.add_argument("--dry-run", action="store_true", help="write and print, submit nothing")
    p.set_defaults(func=cmd_launch)
    p.__class__ = _IntermixedParser
