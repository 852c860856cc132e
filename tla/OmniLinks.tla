-------------------------------- MODULE OmniLinks --------------------------------
(***************************************************************************)
(* Link plans (P-18): stages on the GPUs of one node issue lifecycle      *)
(* commands (a sleep or a wake), and the engine lends each command the    *)
(* host links of GPUs that are idle, which the command's rank relays its  *)
(* copies through (a staging buffer on each lent GPU while it runs). A    *)
(* relay may fail; the command then finishes on its own link.             *)
(*                                                                         *)
(* What the planner must keep: a GPU is lent to one command at a time;    *)
(* never the GPU of a stage that has a command in flight when the plan is *)
(* made, nor the commanding stage's own; a peer never holds more staging  *)
(* than one relay's reserve; a lent GPU is released when its command      *)
(* ends; and every command ends, a failed relay included.                 *)
(*                                                                         *)
(* The topology and the planner's answers come from LinkPlanTable.tla,    *)
(* GENERATED from omni_core/engine/link_plan.py (omni_core.formal.        *)
(* gen_link_plans): the ASSUME below makes TLC check that the Python      *)
(* planner lends exactly what FreeFor lends, for every stage and every    *)
(* set of busy and lent GPUs.                                             *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets, LinkPlanTable

CONSTANTS
    PeerFails,   \* a relay may fail mid-command
    Bug          \* "none" | "lend_twice" | "lend_busy" | "no_release" | "no_fallback"

Stages == DOMAIN Home

VARIABLES
    busy,        \* stage -> a lifecycle command in flight
    lent,        \* stage -> the GPUs the ledger lent to its command
    relays,      \* stage -> the lent GPUs its rank still relays through (staging held)
    staging,     \* GPU -> staging buffers held on it (one per relay through it)
    lentBusy     \* stage -> GPUs that were busy when lent to its command (a ghost, for NoLendBusy)

vars == <<busy, lent, relays, staging, lentBusy>>

\* What the planner lends stage s when busyGpus have commands of their own and lentGpus
\* are lent already: every GPU it reaches peer to peer that is none of those nor its own.
FreeFor(s, busyGpus, lentGpus) == Sees[s] \ (busyGpus \cup lentGpus \cup {Home[s]})

ASSUME \A row \in PlannerRows : FreeFor(row[1], row[2], row[3]) = row[4]

Lent == UNION {lent[s] : s \in Stages}
BusyGpus == {Home[s] : s \in {t \in Stages : busy[t]}}

Plan(s) ==
    CASE Bug = "lend_twice" -> FreeFor(s, BusyGpus, {})
      [] Bug = "lend_busy"  -> FreeFor(s, {}, Lent)
      [] OTHER              -> FreeFor(s, BusyGpus, Lent)

Init ==
    /\ busy = [s \in Stages |-> FALSE]
    /\ lent = [s \in Stages |-> {}]
    /\ relays = [s \in Stages |-> {}]
    /\ staging = [g \in GPUs |-> 0]
    /\ lentBusy = [s \in Stages |-> {}]

\* A stage's sleep or wake starts; the engine plans it once.
Issue(s) ==
    /\ ~busy[s]
    /\ LET p == Plan(s) IN
        /\ busy' = [busy EXCEPT ![s] = TRUE]
        /\ lent' = [lent EXCEPT ![s] = p]
        /\ relays' = [relays EXCEPT ![s] = p]
        /\ staging' = [g \in GPUs |-> staging[g] + IF g \in p THEN 1 ELSE 0]
        /\ lentBusy' = [lentBusy EXCEPT ![s] = p \cap BusyGpus]

\* A relay fails (no staging room, a refused copy, the peer errs): the rank closes every
\* relay of the command (their staging freed) and goes on over its own link.
RelayFails(s) ==
    /\ PeerFails
    /\ busy[s] /\ relays[s] # {}
    /\ relays' = [relays EXCEPT ![s] = {}]
    /\ staging' = [g \in GPUs |-> staging[g] - IF g \in relays[s] THEN 1 ELSE 0]
    /\ UNCHANGED <<busy, lent, lentBusy>>

\* The command ends (every byte landed on whichever links were left); its GPUs go back.
Finish(s) ==
    /\ busy[s]
    /\ Bug = "no_fallback" => relays[s] = lent[s]  \* a bug: a command whose relay failed cannot end
    /\ busy' = [busy EXCEPT ![s] = FALSE]
    /\ lent' = IF Bug = "no_release" THEN lent ELSE [lent EXCEPT ![s] = {}]
    /\ relays' = [relays EXCEPT ![s] = {}]
    /\ staging' = [g \in GPUs |-> staging[g] - IF g \in relays[s] THEN 1 ELSE 0]
    /\ UNCHANGED lentBusy

Next == \E s \in Stages : Issue(s) \/ RelayFails(s) \/ Finish(s)

Spec == Init /\ [][Next]_vars
FairSpec == Spec /\ \A s \in Stages : WF_vars(Finish(s))

TypeOK ==
    /\ busy \in [Stages -> BOOLEAN]
    /\ lent \in [Stages -> SUBSET GPUs]
    /\ relays \in [Stages -> SUBSET GPUs]
    /\ staging \in [GPUs -> Nat]

LentOnce == \A s, t \in Stages : s # t => lent[s] \cap lent[t] = {}
NoLendBusy == \A s \in Stages : lentBusy[s] = {}
NotOwnGpu == \A s \in Stages : Home[s] \notin lent[s]
ReserveBound == \A g \in GPUs : staging[g] <= 1      \* one relay's staging per peer
RelaysLent == \A s \in Stages : relays[s] \subseteq lent[s]
LentOnlyInFlight == \A s \in Stages : lent[s] # {} => busy[s]
CommandsEnd == \A s \in Stages : busy[s] ~> ~busy[s]
==================================================================================
