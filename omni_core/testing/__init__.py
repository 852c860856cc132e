"""What tests, the walkthrough and the fuzzers run the product against, shipped so that a
third party's tests can use it too: the simulated network of the sans-IO cores (`network`),
its script language (`script`) and scenario file format (`scenario`), the transcript's words
(`describe`), the seeded generator (`rng`), fault-injecting doubles (`faults`) and the
fuzzers (`fuzz`). Nothing in the product imports this package, except the walkthrough."""
