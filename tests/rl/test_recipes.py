"""The stage recipes compose with verl 0.9.1's own Hydra configs and pass verl's checks;
`cuda-agent rl launch` writes the config and prints the commands; mistakes are one sentence."""

from __future__ import annotations

import importlib.util
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from cuda_agent.cli import main
from cuda_agent.rl.launch import Launch, recipes_root, resolve, stage_names, write
from cuda_agent.rl.settings import RLSettings

# (found, not imported: importing verl takes seconds, paid by the first test that needs it)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="needs verl 0.9.1")
OmegaConf = pytest.importorskip("omegaconf").OmegaConf

STAGES = ["stage1_single_turn", "stage2_rft", "stage3_critic_pretrain", "stage4_agentic_ppo",
          "ablation_speedup_reward", "ablation_no_rft", "ablation_no_value_pretrain",
          "ablation_no_agent_loop"]
AGENTIC = ["stage3_critic_pretrain", "stage4_agentic_ppo", "ablation_speedup_reward",
           "ablation_no_rft", "ablation_no_value_pretrain"]
SINGLE_TURN = ["stage1_single_turn", "ablation_no_agent_loop"]
TAKES_CRITIC = {"stage4_agentic_ppo", "ablation_speedup_reward", "ablation_no_rft"}
MODEL, CRITIC = "org/rft-actor", "org/stage3-critic"  # not local paths: kept as given
HEAD = "10.1.2.3"


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Launch]:
    # a data folder whose path needs quoting in Hydra's grammar and in a shell
    root = tmp_path_factory.mktemp("launch")
    data = root / "my data" / "it's"
    out: dict[str, Launch] = {}
    for stage in STAGES:
        out[stage] = resolve(stage, model=MODEL, nodes=2, gpus_per_node=8,
                             eval_gpus=None if stage == "stage2_rft" else 4, data=str(data),
                             critic=CRITIC if stage in TAKES_CRITIC else None,
                             out=str(root / stage), ray_address=HEAD)
    return out


def test_every_stage_has_a_recipe_and_a_run_script() -> None:
    assert sorted(STAGES) == stage_names()
    for stage in STAGES:
        run = recipes_root() / stage / "run.sh"
        assert run.stat().st_mode & 0o111
        assert 'cuda-agent rl launch "$here" "$@"' in run.read_text()


@pytest.mark.parametrize("stage", AGENTIC + SINGLE_TURN)
def test_ppo_stages_carry_the_published_settings(launches: dict[str, Launch], stage: str) -> None:
    cfg = launches[stage].config
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    assert cfg.algorithm.adv_estimator == "gae"
    assert (cfg.algorithm.gamma, cfg.algorithm.lam) == (1.0, 0.95)
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.28)
    assert (actor.optim.lr, cfg.critic.optim.lr) == (3e-6, 6e-6)
    assert cfg.data.train_batch_size == actor.ppo_mini_batch_size == 1024
    assert not actor.use_kl_loss and not cfg.algorithm.use_kl_in_reward
    assert rollout.name == "vllm" and rollout.mode == "async"
    context = cfg.data.max_prompt_length + cfg.data.max_response_length
    assert context == rollout.max_model_len == cfg.cuda_agent.context_tokens
    assert actor.ppo_max_token_len_per_gpu >= context and cfg.critic.ppo_max_token_len_per_gpu >= context
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (2, 8)
    assert cfg.actor_rollout_ref.model.path == MODEL
    assert cfg.trainer.save_freq > 0  # verl saves nothing, not even the last step, otherwise
    assert "hf_model" in cfg.critic.checkpoint.save_contents
    assert "hf_model" in actor.checkpoint.save_contents
    assert cfg.trainer.default_local_dir == str(launches[stage].out / "checkpoints")
    settings = RLSettings.from_mapping(cfg.cuda_agent)
    assert settings.eval_pool.ray and settings.eval_pool.workers == 4
    assert settings.eval_pool.resource == "kernel_eval_gpu"
    assert launches[stage].command[:3] == ["ray", "job", "submit"]


@pytest.mark.parametrize("stage", AGENTIC)
def test_agentic_stages_run_our_agent_loop(launches: dict[str, Launch], stage: str) -> None:
    cfg = launches[stage].config
    rollout = cfg.actor_rollout_ref.rollout
    assert cfg.data.max_prompt_length + cfg.data.max_response_length == 131072
    assert rollout.multi_turn.enable and cfg.data.return_raw_chat
    assert rollout.multi_turn.max_assistant_turns == cfg.cuda_agent.max_turns == 150
    assert rollout.agent.default_agent_loop == "cuda_agent" == launches[stage].agent_loop
    registry = Path(rollout.agent.agent_loop_config_path)
    assert registry.is_file() and "cuda_agent.rl.agent_loop.CudaAgentLoop" in registry.read_text()
    assert cfg.data.train_files.endswith("/my data/it's/agentic/train.parquet")
    assert cfg.data.val_files.endswith("/agentic/val.parquet")


@pytest.mark.parametrize("stage", SINGLE_TURN)
def test_single_turn_stages_use_verls_loop_and_our_reward(launches: dict[str, Launch],
                                                          stage: str) -> None:
    cfg = launches[stage].config
    rollout = cfg.actor_rollout_ref.rollout
    assert cfg.data.max_prompt_length + cfg.data.max_response_length == 32768
    assert not rollout.multi_turn.enable
    assert rollout.agent.default_agent_loop == "single_turn_agent"
    reward = cfg.reward.custom_reward_function
    assert Path(reward.path).parts[-3:] == ("cuda_agent", "rl", "reward.py")
    assert reward.name == "compute_score"
    # the kernels go to the evaluation nodes' pool (--eval-gpus 4), not to verl's reward workers' GPUs
    assert OmegaConf.to_container(reward.reward_kwargs, resolve=True) == {
        "reward_name": "milestone", "sandbox": True, "eval_pool": True, "eval_resource": "kernel_eval_gpu",
        "eval_workers": 4, "eval_build_workers": 2}
    assert cfg.critic.model.path == MODEL
    assert cfg.data.train_files.endswith("/single_turn/train.parquet")


def test_stage_specific_values(launches: dict[str, Launch]) -> None:
    steps = {s: (launches[s].config.trainer.critic_warmup, launches[s].config.trainer.total_training_steps)
             for s in AGENTIC + SINGLE_TURN}
    assert steps["stage3_critic_pretrain"] == (20, 20)  # the critic alone, then stop
    assert steps["stage4_agentic_ppo"] == steps["ablation_no_value_pretrain"] == (0, 150)
    assert steps["ablation_no_agent_loop"] == (0, 150)
    critic_of = {s: launches[s].config.critic.model.path for s in AGENTIC}
    assert critic_of["stage4_agentic_ppo"] == critic_of["ablation_no_rft"] == CRITIC
    assert critic_of["stage3_critic_pretrain"] == critic_of["ablation_no_value_pretrain"] == MODEL
    assert launches["ablation_speedup_reward"].config.cuda_agent.reward == "speedup"
    assert launches["stage4_agentic_ppo"].config.cuda_agent.reward == "milestone"


def _changed(a: Launch, b: Launch) -> set[str]:
    def keyed(launch: Launch) -> dict[str, str]:
        return {o.split("=", 1)[0]: o for o in launch.overrides}

    ka, kb = keyed(a), keyed(b)
    return {k for k in ka.keys() | kb.keys() if ka.get(k) != kb.get(k)}


def test_ablations_differ_from_stage_4_only_where_they_say(launches: dict[str, Launch]) -> None:
    base = launches["stage4_agentic_ppo"]
    own = {"trainer.experiment_name", "trainer.default_local_dir"}
    assert _changed(base, launches["ablation_speedup_reward"]) == own | {"+cuda_agent.reward"}
    assert _changed(base, launches["ablation_no_rft"]) == own
    assert _changed(base, launches["ablation_no_value_pretrain"]) == own | {"critic.model.path"}


def test_rft_composes_with_verls_sft_trainer_config(launches: dict[str, Launch]) -> None:
    launch = launches["stage2_rft"]
    cfg = launch.config
    assert cfg.model.path == MODEL and cfg.engine.strategy == "fsdp"
    assert cfg.data.train_files.endswith("/rft/sft.parquet")
    assert (cfg.data.messages_key, cfg.data.tools_key) == ("messages", "tools")
    # the RFT set's rows are read by our dataset class, which verl loads from the package
    assert (cfg.data.custom_cls.path, cfg.data.custom_cls.name) == ("pkg://cuda_agent.rl.sft_dataset", "RFTDataset")
    from verl.utils.import_utils import load_extern_object

    from cuda_agent.rl.sft_dataset import RFTDataset

    assert load_extern_object(cfg.data.custom_cls.path, cfg.data.custom_cls.name) is RFTDataset
    assert cfg.data.max_length == 131072 and cfg.data.micro_batch_size_per_gpu == 1
    assert cfg.optim.lr == 1e-5 and "hf_model" in cfg.checkpoint.save_contents
    assert "cuda_agent" not in cfg
    # two nodes: one torchrun per node, by hand (one node: see the next test but one)
    assert launch.command[0] == "torchrun" and "--node-rank=$NODE_RANK" in launch.command
    assert launch.command[launch.command.index("-m") + 1] == "verl.trainer.sft_trainer"
    script = write(launch)[-1]
    bash = shutil.which("bash") or "/bin/bash"
    assert subprocess.run([bash, "-n", str(script)]).returncode == 0
    run = subprocess.run([bash, str(script)], capture_output=True, text=True,
                         env={"PATH": "/nonexistent"})
    assert run.returncode != 0 and "MASTER_ADDR" in run.stderr  # asks for its node's settings


def test_dry_run_writes_the_config_and_prints_the_commands(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = main(["rl", "launch", "stage4_agentic_ppo", "--model", MODEL, "--critic", CRITIC,
               "--nodes", "4", "--gpus-per-node", "8", "--eval-gpus", "16", "--data", str(tmp_path),
               "--out", str(out), "--ray-address", f"http://{HEAD}:8265", "--dry-run",
               "trainer.save_freq=5", "cuda_agent.max_turns=100"])
    printed = capsys.readouterr().out
    assert rc == 0
    cfg = OmegaConf.load(out / "config.yaml")
    assert cfg.trainer.save_freq == 5 and cfg.trainer.nnodes == 4
    assert cfg.actor_rollout_ref.rollout.multi_turn.max_assistant_turns == 100  # resolved
    assert cfg.cuda_agent.eval_pool.workers == 16 and cfg.cuda_agent.eval_pool.ray is True
    overrides = (out / "overrides.txt").read_text().split()
    assert overrides.count("+cuda_agent.max_turns=100") == 1  # the user's replaced ours in place
    assert not any(o.startswith("+cuda_agent.max_turns=150") for o in overrides)
    submit = next(line for line in printed.splitlines() if "ray job submit" in line)
    words = shlex.split(submit)
    sep = words.index("--")
    assert words[sep + 1:sep + 4] == ["python3", "-m", "verl.trainer.main_ppo"]
    assert words[sep + 4:] == overrides
    assert words[words.index("--address") + 1] == f"http://{HEAD}:8265"
    assert shlex.split((out / "command.sh").read_text().splitlines()[-1]) == words
    assert f"ray start --address={HEAD}:6379 --num-gpus=0" in printed
    assert """--resources='{"kernel_eval_gpu": G}'""" in printed
    assert "NOT the training GPUs" in printed and "4 node(s) x 8 GPUs = 32 GPUs" in printed


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cuda-agent: ") and len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_mistakes_are_one_sentence_and_exit_2(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--model", MODEL, "--nodes", "1", "--gpus-per-node", "8", "--out", str(tmp_path),
              "--dry-run"]
    err = _fails(["rl", "launch", "stage5_magic", *common, "--eval-gpus", "1"], capsys)
    assert "no stage 'stage5_magic'" in err and "stage4_agentic_ppo" in err
    four = ["rl", "launch", "stage4_agentic_ppo", *common, "--critic", CRITIC, "--eval-gpus", "1"]
    err = _fails([*four, "actor_rollout_ref.actor.clip_ratio_hgh=0.3"], capsys)
    assert "clip_ratio_hgh" in err
    assert "bad override" in _fails([*four, "trainer.save_freq=="], capsys)
    assert "cuda_agent has no key" in _fails([*four, "+cuda_agent.max_turn=3"], capsys)
    # a value verl's own validators reject
    assert "verl's checks" in _fails([*four, "actor_rollout_ref.actor.use_dynamic_bsz=false"], capsys)
    assert "needs --critic" in _fails(["rl", "launch", "stage4_agentic_ppo", *common,
                                       "--eval-gpus", "1"], capsys)
    assert "--eval-gpus" in _fails(["rl", "launch", "stage4_agentic_ppo", *common,
                                    "--critic", CRITIC], capsys)
    assert "does not take --critic" in _fails(["rl", "launch", "stage2_rft", *common,
                                               "--critic", CRITIC], capsys)


def test_submitting_without_ray_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no `ray` there
    err = _fails(["rl", "launch", "stage2_rft", "--model", MODEL, "--nodes", "1",
                  "--gpus-per-node", "8", "--out", str(tmp_path)], capsys)
    assert "'ray' executable is not on PATH" in err
    # written before the attempt: on one node the RFT's torchrun goes through Ray too
    words = shlex.split((tmp_path / "command.sh").read_text().splitlines()[-1])
    sep = words.index("--")
    assert words[:3] == ["ray", "job", "submit"] and words[sep - 2:sep] == ["--entrypoint-num-gpus", "8"]
    assert words[sep + 1:sep + 7] == ["torchrun", "--nnodes=1", "--nproc-per-node=8", "--standalone",
                                      "-m", "verl.trainer.sft_trainer"]
    assert OmegaConf.load(tmp_path / "config.yaml").model.path == MODEL
