#!/usr/bin/env bash
# Regenerate every file derived from the code (after a merge, or a change to the tables, the
# wire messages or the routes); tests check each one is fresh. Leaves the TLC runs and the fsm
# mutation score (`python scripts/mutate_fsm.py --out tla/fsm_mutation.md`) to the caller.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
python -m omni_core.formal.gen_transitions
python -m omni_core.formal.gen_link_plans
python -m omni_core.formal.gen_versions
python -m omni_core.formal.gen_transfers
omni-core schema
omni-core docs
omni-core serve --write-openapi specs/openapi.json
