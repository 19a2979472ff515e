# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The TRL releases the trainer was tested on, and each private member of
TRL it overrides or relies on (`rl/tests/test_rl_seams.py` fails
loudly when TRL changes one)."""

# The TRL releases this package was tested on: it overrides and reaches
# private members of TRL's GRPO trainer.
SUPPORTED_TRL_VERSIONS = ("1.16.0", )
# Each TRL member the package overrides or relies on: why, and the sha256
# of its source in the supported release. Removable when TRL's rollout
# functions can return rows of their own (children, a tree's layout)
# and take engine arguments.
TRL_SEAMS = {
    "trl.trainer.grpo_trainer:GRPOTrainer._generate":
    ("overridden: each root's row extended with its tree (packed), or "
     "children's rows appended to the roots' rows; relies on its 8-tuple "
     "and on syncing weights only when `_last_loaded_step` differs from "
     "the step",
     "2a27fdf8f5e6f3562508eec3efb9e9dade2e0bf810de5031cdfab429d0a048f2"),
    "trl.trainer.grpo_trainer:GRPOTrainer._calculate_rewards":
    ("overridden: rewards score the roots' own tokens only; its "
     "per-function "
     "rewards (one row per completion) are checked for small spreads "
     "that scaled advantages would magnify",
     "736ae29b083840b5da2638b55ad1258659c644589991fe6a494131354952efef"),
    "trl.trainer.grpo_trainer:GRPOTrainer._generate_and_score_completions":
    ("overridden: children's rows get their root's advantage; a packed "
     "row's sequence-level importance-sampling ratio is made per node; "
     "relies on it building every other per-row tensor from `_generate`'s "
     "rows in their order, the advantages from the first len(prompts) "
     "rows, and the old and reference logprobs through "
     "`_get_per_token_logps_and_entropies` before it returns",
     "1fa48922792dcd5c72da155cfe99db477771a7c61cde15519fe8c86d0cdc0b65"),
    "trl.trainer.grpo_trainer:GRPOTrainer._get_per_token_logps_and_entropies":
    ("overridden for packed rows: its forward through the fused LM head "
     "(`labels`, `fused_lm_head=True`, `log_probs`, `entropy`), with the "
     "trees' attention mask and positions; relies on `input_ids` being "
     "the left-padded prompt, then the completion",
     "ea73c3909275851d0cd664b1e7694905fdcd9c285e848ae923d7402234f2edce"),
    "trl.trainer.grpo_trainer:GRPOTrainer._compute_loss":
    ("overridden: the micro-batch's tree layout for its forward; relies on "
     "it calling `_get_per_token_logps_and_entropies` once, on its "
     "inputs' prompt and completion",
     "80295546bbdbf6f711acce7f6e69b0100ab40aa8f23ed8052cc564ff024e3e40"),
    "trl.generation.vllm_generation:VLLMGeneration._init_vllm":
    ("relied on: builds the colocated engine with the module's `LLM` "
     "name, which `hooked_trl_engine` swaps",
     "0e584002e0f6a9c006aaec0e91ecc996ae8c0d3b2ff8491fbf08b484a57d20ce"),
    "trl.generation.vllm_generation:VLLMGeneration._iter_named_params":
    ("called: the trainer's weights as vLLM names them, loaded while the "
     "iterator holds them (PEFT merges the adapters for the iteration only)",
     "baab615d5c7bc3e126cec1430f29213c984b275285b08a269cbfbf0adc2617b8"),
    "trl.generation.vllm_generation:VLLMGeneration.sync_weights":
    ("replaced (never called): it loads tensors one by one, which vLLM's "
     "CPU backend cannot take after start",
     "63d669fb32304ff5e275443abc5e4a2c1e6974ba196d30074bc0f2519f98644c"),
}
