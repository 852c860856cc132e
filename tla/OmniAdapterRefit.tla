---------------------------- MODULE OmniAdapterRefit ----------------------------
\* Adapter-only refit (P-20) across the ranks of one stage: a refit sends an adapter's new
\* tensors (content c) as version v to every rank, and each rank commits it or refuses it on
\* its own (a bucket it cannot open, a raise while writing): a refit may reach some ranks only.
\* A request runs on every rank with the version (and so the tensors) that rank holds; the stage
\* answers it only when every rank ran one version (omni_core/fsm/stage_requests.py). That check
\* is sound only if a version names one content: the engine never sends a version at or below
\* one it sent before for the adapter (engine/adapter_calls.py), and a rank refuses a version
\* not above the one it holds (omni_core/fsm/adapters.py).
\*
\* Bug models: "straddle" (the stage answers with rank 0's result without comparing the
\* ranks' versions), "reuse_version" (the engine sends a version it sent before, with other
\* tensors, after a refit that reached some ranks only).
EXTENDS Naturals, FiniteSets

CONSTANTS Ranks, MaxVersion, Contents, Bug

ASSUME Bug \in {"none", "straddle", "reuse_version"}
ASSUME MaxVersion \in Nat /\ "c0" \in Contents

Versions == 0..MaxVersion
Pairs == [v : Versions, c : Contents]
NoAnswer == [answered |-> FALSE, ran |-> {}]

VARIABLES
    held,    \* rank -> the version and content of the adapter it holds (version 0: as first added)
    sent,    \* the highest version the engine sent for the adapter
    answer   \* the stage's last answer to a request: answered or refused, and what its ranks ran

vars == <<held, sent, answer>>

TypeOK ==
    /\ held \in [Ranks -> Pairs]
    /\ sent \in Versions
    /\ answer \in [answered : BOOLEAN, ran : SUBSET Pairs]

Init ==
    /\ held = [r \in Ranks |-> [v |-> 0, c |-> "c0"]]
    /\ sent = 0
    /\ answer = NoAnswer

\* A refit of version v with content c: every rank that gets it whole and holds a lower
\* version commits it; the others keep what they hold.
Refit(v, c, reached) ==
    /\ v > sent \/ Bug = "reuse_version"
    /\ held' = [r \in Ranks |-> IF r \in reached /\ v > held[r].v THEN [v |-> v, c |-> c] ELSE held[r]]
    /\ sent' = IF v > sent THEN v ELSE sent
    /\ UNCHANGED answer

\* A request on every rank: answered when every rank ran one version (Bug straddle: always).
Serve ==
    LET ran == {held[r] : r \in Ranks}
        one == Cardinality({p.v : p \in ran}) = 1
    IN answer' = [answered |-> one \/ Bug = "straddle", ran |-> ran]
    /\ UNCHANGED <<held, sent>>

Next ==
    \/ \E v \in 1..MaxVersion, c \in Contents, reached \in SUBSET Ranks : Refit(v, c, reached)
    \/ Serve

Spec == Init /\ [][Next]_vars

\* No answered request ran on two sets of tensors: every rank ran the same version and content.
NoStraddle == answer.answered => Cardinality(answer.ran) = 1
================================================================================
