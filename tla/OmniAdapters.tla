------------------------------ MODULE OmniAdapters ------------------------------
\* LoRA adapters under sleep (P-20), per rank: each rank's adapter table (what ListAdapters
\* reports and what an Execute is checked against, omni_core/fsm/adapters.py) beside the
\* adapters' memory itself, through level-1 and level-2 sleeps, wakes, reloads and weight
\* updates. The rank's lifecycle moves by the rows of the worker table (OmniTransitions,
\* generated from omni_core/fsm/worker_table.py): an adapter command or a request is taken
\* only where its trigger's row allows it.
\*
\* Bug models: "gone_unnoticed" (a level-2 sleep discards the adapters' pool and the table
\* keeps them loaded), "other_base" (an adapter made for other base weights is loaded without
\* rebind), "no_stale" (an update leaves the adapters bound to the old weights loaded).
EXTENDS Naturals, OmniTransitions

CONSTANTS Ranks, AdapterNames, MaxVersion, Bug

ASSUME Bug \in {"none", "gone_unnoticed", "other_base", "no_stale"}
ASSUME MaxVersion \in Nat

Versions == 0..MaxVersion
Status == {"absent", "loaded", "gone", "stale"}
Memory == {"none", "valid", "discarded"}
NoServe == [adapter |-> "-", intact |-> TRUE, on_base |-> TRUE]

VARIABLES
    wstate,   \* rank -> its worker state (settled states only: an effect completes at once)
    level,    \* rank -> the level of its last sleep
    version,  \* rank -> the weights version it holds
    table,    \* rank -> adapter -> status in the rank's adapter table
    base,     \* rank -> adapter -> the base version the table binds it to
    mem,      \* rank -> adapter -> what the adapters' pool holds for it
    served    \* rank -> the last request it ran with an adapter, and what that adapter was

vars == <<wstate, level, version, table, base, mem, served>>

TypeOK ==
    /\ wstate \in [Ranks -> WorkerStates]
    /\ level \in [Ranks -> {1, 2}]
    /\ version \in [Ranks -> Versions]
    /\ table \in [Ranks -> [AdapterNames -> Status]]
    /\ base \in [Ranks -> [AdapterNames -> Versions]]
    /\ mem \in [Ranks -> [AdapterNames -> Memory]]
    /\ served \in [Ranks -> [adapter : AdapterNames \cup {"-"}, intact : BOOLEAN, on_base : BOOLEAN]]

Init ==
    /\ wstate = [r \in Ranks |-> "ACTIVE"]
    /\ level = [r \in Ranks |-> 1]
    /\ version = [r \in Ranks |-> 0]
    /\ table = [r \in Ranks |-> [a \in AdapterNames |-> "absent"]]
    /\ base = [r \in Ranks |-> [a \in AdapterNames |-> 0]]
    /\ mem = [r \in Ranks |-> [a \in AdapterNames |-> "none"]]
    /\ served = [r \in Ranks |-> NoServe]

Legal(r, trigger) == WorkerLegal(wstate[r], trigger)

\* The table after the base weights became version v: each loaded adapter bound to another is stale.
Rebased(r, v) == [a \in AdapterNames |->
    IF table[r][a] = "loaded" /\ base[r][a] # v /\ Bug # "no_stale" THEN "stale" ELSE table[r][a]]

\* AddAdapter made for base version b (rebind: bound to the weights held now instead).
Add(r, a, b, rebind) ==
    /\ Legal(r, "add_adapter")
    /\ b = version[r] \/ rebind \/ Bug = "other_base"
    /\ table' = [table EXCEPT ![r][a] = "loaded"]
    /\ base' = [base EXCEPT ![r][a] = IF rebind THEN version[r] ELSE b]
    /\ mem' = [mem EXCEPT ![r][a] = "valid"]
    /\ UNCHANGED <<wstate, level, version, served>>

Remove(r, a) ==
    /\ Legal(r, "remove_adapter")
    /\ table[r][a] # "absent"
    /\ table' = [table EXCEPT ![r][a] = "absent"]
    /\ mem' = [mem EXCEPT ![r][a] = "none"]
    /\ UNCHANGED <<wstate, level, version, base, served>>

\* A sleep of every tag: level 1 offloads the adapters with the weights (restored bit for bit
\* at the wake), level 2 discards their pool and the table says so.
Sleep(r, l) ==
    /\ wstate[r] = "ACTIVE"
    /\ Legal(r, "sleep")
    /\ WorkerNext(WorkerNext(wstate[r], "sleep"), "offloaded") = "SLEEPING"
    /\ wstate' = [wstate EXCEPT ![r] = "SLEEPING"]
    /\ level' = [level EXCEPT ![r] = l]
    /\ mem' = IF l = 2 THEN [mem EXCEPT ![r] = [a \in AdapterNames |->
                  IF mem[r][a] = "valid" THEN "discarded" ELSE mem[r][a]]] ELSE mem
    /\ table' = IF l = 2 /\ Bug # "gone_unnoticed" THEN [table EXCEPT ![r] = [a \in AdapterNames |->
                    IF table[r][a] = "absent" THEN "absent" ELSE "gone"]] ELSE table
    /\ UNCHANGED <<version, base, served>>

Wake(r) ==
    /\ Legal(r, "wake")
    /\ LET settled == IF level[r] = 2 THEN "needs_reload" ELSE "active" IN
       /\ WorkerNext("RESTORING", Restored[settled]) = RankState[settled]
       /\ wstate' = [wstate EXCEPT ![r] = RankState[settled]]
    /\ UNCHANGED <<level, version, table, base, mem, served>>

\* A reload brings the runner's own weights back: version 0.
Reload(r) ==
    /\ Legal(r, "reload")
    /\ wstate[r] = "NEEDS_RELOAD"
    /\ WorkerNext("RELOADING", Reloaded.active) = "ACTIVE"
    /\ wstate' = [wstate EXCEPT ![r] = "ACTIVE"]
    /\ version' = [version EXCEPT ![r] = 0]
    /\ table' = [table EXCEPT ![r] = Rebased(r, 0)]
    /\ UNCHANGED <<level, base, mem, served>>

Update(r) ==
    /\ Legal(r, "update")
    /\ wstate[r] = "ACTIVE"
    /\ version[r] < MaxVersion
    /\ version' = [version EXCEPT ![r] = version[r] + 1]
    /\ table' = [table EXCEPT ![r] = Rebased(r, version[r] + 1)]
    /\ UNCHANGED <<wstate, level, base, mem, served>>

\* A request naming adapter a runs only where the table has it loaded (else ADAPTER_UNAVAILABLE,
\* nothing changes); what it ran with is recorded for the invariants.
Execute(r, a) ==
    /\ Legal(r, "execute")
    /\ table[r][a] = "loaded"
    /\ served' = [served EXCEPT ![r] =
           [adapter |-> a, intact |-> mem[r][a] = "valid", on_base |-> base[r][a] = version[r]]]
    /\ UNCHANGED <<wstate, level, version, table, base, mem>>

Next ==
    \E r \in Ranks :
        \/ \E a \in AdapterNames, b \in Versions, rebind \in BOOLEAN : Add(r, a, b, rebind)
        \/ \E a \in AdapterNames : Remove(r, a) \/ Execute(r, a)
        \/ \E l \in {1, 2} : Sleep(r, l)
        \/ Wake(r) \/ Reload(r) \/ Update(r)

Spec == Init /\ [][Next]_vars

\* No request runs with an adapter whose memory a sleep discarded (level 2 noticed).
AdapterServedIntact == \A r \in Ranks : served[r].intact

\* No request runs with an adapter on base weights other than those it is bound to.
AdapterServedOnItsBase == \A r \in Ranks : served[r].on_base

\* What ListAdapters says is what the pool holds: a loaded adapter's memory is valid.
ListTellsTheTruth == \A r \in Ranks, a \in AdapterNames : table[r][a] = "loaded" => mem[r][a] = "valid"
================================================================================
