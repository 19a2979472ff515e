# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Runs APR's controller on stock vLLM in a process of its own and writes
the searches as JSON (as `run_threadweaver` does for ThreadWeaver).

Usage (in .venv-v1): python -m sequence_hooks_references.formats.run_apr
    MODEL CASES.json OUT.json [--url URL] [--max-model-len N]

CASES.json is a list of cases, each ``{"name", "prompts": [prefix text],
"max_tokens": N, "sampling": {...}}``; every call sends the model's BOS
as text before its prefix (the reference's ``ADD_BOS``).
"""

import dataclasses
import json

from sequence_hooks_references.formats.apr_controller import (APRController,
                                                              run_apr)
from sequence_hooks_references.formats.run_threadweaver import (backend_for,
                                                                runner_parser)


def main() -> None:
    parser = runner_parser(__doc__)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
    from transformers import AutoTokenizer
    bos = AutoTokenizer.from_pretrained(args.model).bos_token or ""
    backend = backend_for(args.model, args.url, args.max_model_len)
    results = []
    for case in json.loads(args.cases.read_text()):
        searches = run_apr(APRController(bos, case["max_tokens"]), backend,
                           case["prompts"], case.get("sampling"))
        results.append({
            "name": case["name"],
            "searches": [dataclasses.asdict(s) for s in searches],
        })
    args.out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
