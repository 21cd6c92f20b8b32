"""Agentic RL on verl: the CUDA Agent recipe driving our agent loop, tools and evaluator.

Modules (verl 0.9.1 is needed only by those marked *, imported when used):

- `token_client`: a `ModelClient` over verl's token server (`server_manager.generate`),
  keeping the exact token ids, the response mask and the log-probs of an episode *
- `agent_loop`: `CudaAgentLoop`, the verl agent loop that runs `cuda-agent optimize`'s
  episode code; registered through `agent_loops.yaml` *
- `eval_pool`: evaluations sent to Ray actors holding evaluation GPUs (not the training ones)
- `data`: `cuda-agent rl prepare`: tasks to verl's RL parquet, and the single-turn set
- `reward`: the single-turn stage's reward function (kernel from the response, then the evaluator)
- `rft`: `cuda-agent rl rft-filter`: trajectories to the rejection fine-tuning set
- `launch`: `cuda-agent rl launch`: the stage recipes resolved and submitted with Ray
- `smoke`: `cuda-agent rl smoke`: one tiny end-to-end PPO step *

Nothing in `cuda_agent.evaluator` imports this package.
"""
