"""Rewards computed by a model, behind the one reward API (``nexrl_hpc.rewards``).

- classifier: an ``AutoModelForSequenceClassification`` directory scoring (prompt, response);
- judge, judge_parse: an LLM judge through the OpenAI-compatible client, a rubric, its score parsed;
- reward: ``run_reward(config)``: the rollout worker's reward with the model reward in it;
- service: ``RewardService``, the scorer as a role on ranks of its own (called over the signed RPC);
- checks: the ``reward_model`` config checks.
"""
