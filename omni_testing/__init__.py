"""What tests, the walkthrough and the fuzzers run the product against: a package beside
`omni_core`, not inside it (as etcd's `rafttest` is beside `raft`), shipped in the same wheel
so that a third party's tests and `omni-core walkthrough` can use it: the simulated network of
the sans-IO cores (`network`), its script language (`script`) and scenario file format
(`scenario`), the transcript's words (`describe`), the seeded generator (`rng`),
fault-injecting doubles (`faults`) and the fuzzers (`fuzz`). `omni_core` never imports this
package; the walkthrough verb of its CLI loads it on demand."""
