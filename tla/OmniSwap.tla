-------------------------------- MODULE OmniSwap --------------------------------
(***************************************************************************)
(* One swap on one device (issue 14 item 2): stage A (out) sleeps while    *)
(* stage B (in) wakes, both at once, with no grant between them: each     *)
(* incoming rank asks its memory gate before it maps an allocation, and    *)
(* the gate admits when the device's free memory covers it. A tensor-      *)
(* parallel stage repeats this model per GPU, rank by rank: rank r of A    *)
(* and rank r of B share GPU r, and no rank reads another GPU's memory.    *)
(*                                                                         *)
(* Memory is counted in chunks. The driver enforces the capacity: a map    *)
(* that does not fit is refused (an OOM event), it never over-commits.    *)
(* A third process allocates and frees at will (bounded). What the model  *)
(* checks is what the gate and the rollback add on top: B never fails     *)
(* because of an OOM, a refused wake leaves B exactly as it was (nothing  *)
(* of this wake mapped, tags asleep, its host copies untouched), an awake *)
(* B holds all of itself, and the swap always ends (the wait expires).    *)
(*                                                                         *)
(* The gate (omni_core/workers/memory_gate.py) keeps a running budget: it *)
(* queries free memory only when the budget does not cover the next       *)
(* allocation (Admit vs Query); an OOM on an admitted map (a third process *)
(* raced it) empties the budget and waits again; while waiting it polls   *)
(* until the deadline (Expire), then rolls back and answers NO_MEMORY.    *)
(* Optionally a second incoming stage C races B for what A frees, or      *)
(* (OneIncoming) starts only once B's wake has ended, as the engine does. *)
(*                                                                         *)
(* Abstractions: a chunk is the unit of every allocation; polling with    *)
(* backoff is one Query step that may repeat; the deadline is a step that *)
(* may happen at any time once a stage is waiting (the gate looks at the  *)
(* clock only while it waits); A's copies landing are its Land steps.      *)
(***************************************************************************)
EXTENDS Naturals, Sequences

CONSTANTS
    Cap,            \* the device's capacity, in chunks
    SizeA,          \* chunks the outgoing stage A holds when the swap starts
    KvA,            \* of which KV cache, discarded at once by A's Sleep (KvA <= SizeA)
    AllocB,         \* B's allocations in chunks, in the order its wake maps them (a sequence)
    AllocC,         \* a second incoming stage C's allocations; <<>>: there is no C
    OtherInit,      \* chunks a third process holds when the swap starts
    OtherMax,       \* the third process never holds more than this
    OtherMoves,     \* it allocates or frees a chunk at most this many times
    Reserve,        \* chunks the gate leaves free (its reserve)
    MayWait,        \* TRUE: the Wake's memory_wait_s > 0; FALSE: 0, refused at once
    AFails,         \* TRUE: A's sleep may fail midway and stop releasing
    DeadlinePasses, \* TRUE: an incoming stage's wait may expire
    LongWait,       \* TRUE: only once A's sleep has ended and the stage's last poll saw the
                    \*   room there is now (memory_wait_s outlasts A's sleep and a poll)
    WaitOutlastsA,  \* TRUE: a stage's wait expires only once A's sleep has ended (its
                    \*   memory_wait_s outlasts A's sleep; LongWait without the poll)
    OneIncoming,    \* TRUE: the engine admits one incoming wake per device at a time: C's
                    \*   wake starts only once B's has ended
    Bug             \* "none" or the defect of a bug model (see BugNames)

(* Each bug model carries one known defect:
     no_gate       B maps without asking the gate; the driver's OOM fails it (NoOOMFailure)
     oom_fatal     an OOM on a map the gate admitted fails B (NoOOMFailure)
     no_rollback   an expired wait answers NO_MEMORY but leaves what it mapped (RefusedExact)
     wait_forever  B never gives up waiting (SwapEnds, when A fails)
     oom_refund    an OOM refunds the budget instead of emptying it: B retries the map from
                   its stale budget, never waits, so never expires (SwapEnds)
     free_host_early  B frees each host copy as its map lands (as A frees device memory as
                   its copy lands): a later refusal has nothing left to restore (RefusedExact)
     two_incoming  the engine issues C's wake while B's is in flight, OneIncoming or not: the
                   model is then OneIncoming = FALSE's (NotBothRefused)
     late_always   A keeps its memory until its last copy although B needs it (LateNeverBlocks) *)
BugNames == {"none", "no_gate", "oom_fatal", "no_rollback", "wait_forever", "oom_refund",
             "free_host_early", "two_incoming", "late_always"}

ASSUME /\ Bug \in BugNames
       /\ KvA <= SizeA
       /\ SizeA + OtherInit <= Cap
       /\ OtherInit <= OtherMax
       /\ MayWait \in BOOLEAN /\ AFails \in BOOLEAN /\ DeadlinePasses \in BOOLEAN
       /\ LongWait \in BOOLEAN /\ WaitOutlastsA \in BOOLEAN /\ OneIncoming \in BOOLEAN

VARIABLES
    a,          \* chunks A holds
    pcA,        \* "kv" (discarding KV), "copying", "asleep", "failed"
    other,      \* chunks the third process holds
    moves,      \* its moves so far
    pc,         \* per incoming stage: "acquire", "map", "awake", "refused", "failed"
    next,       \* index of its next allocation to map
    mapped,     \* chunks this wake has mapped
    budget,     \* the gate's running budget, in chunks
    waiting,    \* its last look found too little room: it is polling, the deadline may pass
    tags,       \* "asleep" or "awake": its tags, as its WorkerCore will report them
    host        \* chunks of its host copy still valid (what a later wake restores from)

(* Allocation lists the configs substitute (AllocB <- Alloc_2_1_1): a TLC 2.15 config
   cannot write a tuple. *)
Alloc_none == <<>>
Alloc_2 == <<2>>
Alloc_1_1 == <<1, 1>>
Alloc_1_2 == <<1, 2>>
Alloc_2_1 == <<2, 1>>
Alloc_2_1_1 == <<2, 1, 1>>
Alloc_2_2_1 == <<2, 2, 1>>
Alloc_1_1_1 == <<1, 1, 1>>

vars == <<a, pcA, other, moves, pc, next, mapped, budget, waiting, tags, host>>

Incoming == IF AllocC = <<>> THEN {"B"} ELSE {"B", "C"}
Alloc(s) == IF s = "B" THEN AllocB ELSE AllocC
SumSeq(q) == LET f[i \in 0..Len(q)] == IF i = 0 THEN 0 ELSE f[i - 1] + q[i] IN f[Len(q)]
Size(s) == SumSeq(Alloc(s))
Need(s) == Alloc(s)[next[s]]
MappedIn == mapped["B"] + (IF "C" \in Incoming THEN mapped["C"] ELSE 0)
(* A's rank is told what B wakes (Sleep.incoming_bytes) and keeps its memory until its last
   copy when the device has room for B beside it (workers/memory_gate.py room_for; decided
   here on the swap's first state, which admits at least the runs the rank's later look does):
   then it holds all of itself until it is asleep, while `a` still counts what is left to copy. *)
Late == Bug = "late_always" \/ Cap >= SizeA + OtherInit + Reserve + Size("B")
HeldA == IF Late /\ pcA # "asleep" THEN SizeA ELSE a
Used == HeldA + other + MappedIn
Free == Cap - Used
Room == IF Free > Reserve THEN Free - Reserve ELSE 0    \* what the gate may admit
Ended(s) == pc[s] \in {"awake", "refused", "failed"}

Init ==
    /\ a = SizeA /\ pcA = "kv"
    /\ other = OtherInit /\ moves = 0
    /\ pc = [s \in Incoming |-> IF Len(Alloc(s)) = 0 THEN "awake" ELSE "acquire"]
    /\ next = [s \in Incoming |-> 1]
    /\ mapped = [s \in Incoming |-> 0]
    /\ budget = [s \in Incoming |-> 0]
    /\ waiting = [s \in Incoming |-> FALSE]
    /\ tags = [s \in Incoming |-> IF Len(Alloc(s)) = 0 THEN "awake" ELSE "asleep"]
    /\ host = [s \in Incoming |-> Size(s)]

----------------------------------------------------------------------------
(* A: an ordinary Sleep of the fast backend. *)
DiscardKv ==
    /\ pcA = "kv"
    /\ a' = a - KvA
    /\ pcA' = IF a' = 0 THEN "asleep" ELSE "copying"
    /\ UNCHANGED <<other, moves, pc, next, mapped, budget, waiting, tags, host>>

Land ==     \* one weight chunk's copy landed on the host: its device memory is released
    /\ pcA = "copying"
    /\ a' = a - 1
    /\ pcA' = IF a' = 0 THEN "asleep" ELSE "copying"
    /\ UNCHANGED <<other, moves, pc, next, mapped, budget, waiting, tags, host>>

AFail ==    \* the sleep fails midway: A keeps what it still holds
    /\ AFails /\ pcA \in {"kv", "copying"}
    /\ pcA' = "failed"
    /\ UNCHANGED <<a, other, moves, pc, next, mapped, budget, waiting, tags, host>>

(* The third process: the driver refuses its allocations over the capacity too. *)
OtherAlloc ==
    /\ moves < OtherMoves /\ other < OtherMax /\ Used + 1 <= Cap
    /\ other' = other + 1 /\ moves' = moves + 1
    /\ UNCHANGED <<a, pcA, pc, next, mapped, budget, waiting, tags, host>>

OtherFree ==
    /\ moves < OtherMoves /\ other > 0
    /\ other' = other - 1 /\ moves' = moves + 1
    /\ UNCHANGED <<a, pcA, pc, next, mapped, budget, waiting, tags, host>>

----------------------------------------------------------------------------
(* An incoming stage s: its wake's gate and maps. *)
Rollback(s) ==      \* unmap what this wake mapped; the host copies were never touched
    /\ pc' = [pc EXCEPT ![s] = "refused"]
    /\ mapped' = IF Bug = "no_rollback" THEN mapped ELSE [mapped EXCEPT ![s] = 0]
    /\ budget' = [budget EXCEPT ![s] = 0]
    /\ waiting' = [waiting EXCEPT ![s] = FALSE]
    /\ UNCHANGED <<next, tags>>

Admit(s) ==         \* the running budget covers the next allocation: no query
    /\ pc[s] = "acquire" /\ Bug # "no_gate"
    /\ budget[s] >= Need(s)
    /\ budget' = [budget EXCEPT ![s] = @ - Need(s)]
    /\ pc' = [pc EXCEPT ![s] = "map"]
    /\ waiting' = [waiting EXCEPT ![s] = FALSE]
    /\ UNCHANGED <<a, pcA, other, moves, next, mapped, tags, host>>

Query(s) ==         \* the budget does not cover it: read free memory (one poll)
    /\ pc[s] = "acquire" /\ Bug # "no_gate"
    /\ budget[s] < Need(s)
    /\ IF Room >= Need(s)
       THEN /\ budget' = [budget EXCEPT ![s] = Room - Need(s)]
            /\ pc' = [pc EXCEPT ![s] = "map"]
            /\ waiting' = [waiting EXCEPT ![s] = FALSE]
            /\ UNCHANGED <<mapped, next, tags>>
       ELSE IF MayWait
            THEN /\ budget' = [budget EXCEPT ![s] = Room]
                 /\ waiting' = [waiting EXCEPT ![s] = TRUE]
                 /\ UNCHANGED <<pc, mapped, next, tags>>
            ELSE Rollback(s)        \* memory_wait_s = 0: refused at once
    /\ UNCHANGED <<a, pcA, other, moves, host>>

Blind(s) ==         \* no_gate: straight to the map
    /\ pc[s] = "acquire" /\ Bug = "no_gate"
    /\ pc' = [pc EXCEPT ![s] = "map"]
    /\ UNCHANGED <<a, pcA, other, moves, next, mapped, budget, waiting, tags, host>>

Map(s) ==
    /\ pc[s] = "map"
    /\ IF Used + Need(s) <= Cap
       THEN /\ mapped' = [mapped EXCEPT ![s] = @ + Need(s)]
            /\ next' = [next EXCEPT ![s] = @ + 1]
            /\ IF next[s] = Len(Alloc(s))
               THEN pc' = [pc EXCEPT ![s] = "awake"] /\ tags' = [tags EXCEPT ![s] = "awake"]
               ELSE pc' = [pc EXCEPT ![s] = "acquire"] /\ UNCHANGED tags
            /\ UNCHANGED <<budget, waiting>>
       ELSE \* the driver refuses the map: an OOM event
            IF Bug \in {"no_gate", "oom_fatal"}
            THEN /\ pc' = [pc EXCEPT ![s] = "failed"]
                 /\ UNCHANGED <<mapped, next, budget, waiting, tags>>
            ELSE IF Bug = "oom_refund"
            THEN /\ pc' = [pc EXCEPT ![s] = "acquire"]
                 /\ budget' = [budget EXCEPT ![s] = @ + Need(s)]
                 /\ UNCHANGED <<mapped, next, waiting, tags>>
            ELSE IF MayWait
            THEN /\ pc' = [pc EXCEPT ![s] = "acquire"]      \* not free yet: wait again
                 /\ budget' = [budget EXCEPT ![s] = 0]
                 /\ waiting' = [waiting EXCEPT ![s] = TRUE]
                 /\ UNCHANGED <<mapped, next, tags>>
            ELSE Rollback(s)
    /\ host' = IF Bug = "free_host_early" /\ Used + Need(s) <= Cap
               THEN [host EXCEPT ![s] = @ - Need(s)] ELSE host
    /\ UNCHANGED <<a, pcA, other, moves>>

Expire(s) ==        \* memory_wait_s has passed since the wake began, while waiting
    /\ DeadlinePasses /\ Bug # "wait_forever"
    /\ LongWait => pcA \in {"asleep", "failed"} /\ budget[s] = Room
    /\ WaitOutlastsA => pcA \in {"asleep", "failed"}
    /\ pc[s] = "acquire" /\ waiting[s]
    /\ Rollback(s)
    /\ UNCHANGED <<a, pcA, other, moves, host>>

(* One incoming wake per device at a time (the engine's swap slots, engine/incoming.py):
   C's wake is issued once B's has ended. *)
Issued(s) == OneIncoming /\ Bug # "two_incoming" /\ s = "C" => Ended("B")

InStep(s) == Issued(s) /\ (Admit(s) \/ Query(s) \/ Blind(s) \/ Map(s) \/ Expire(s))

Next ==
    \/ DiscardKv \/ Land \/ AFail \/ OtherAlloc \/ OtherFree
    \/ \E s \in Incoming : InStep(s)

Spec == Init /\ [][Next]_vars

(* Fairness: A's copies keep landing unless it failed; each incoming stage keeps polling,
   mapping and (when the deadline may pass) expiring. The third process needs none. *)
FairSpec ==
    /\ Spec
    /\ WF_vars(DiscardKv) /\ WF_vars(Land)
    /\ \A s \in Incoming : WF_vars(Issued(s) /\ Admit(s)) /\ WF_vars(Issued(s) /\ Query(s))
                           /\ WF_vars(Issued(s) /\ Blind(s)) /\ WF_vars(Issued(s) /\ Map(s))
                           /\ WF_vars(Issued(s) /\ Expire(s))

----------------------------------------------------------------------------
TypeOK ==
    /\ a \in 0..SizeA /\ pcA \in {"kv", "copying", "asleep", "failed"}
    /\ other \in 0..OtherMax /\ moves \in 0..OtherMoves
    /\ \A s \in Incoming :
          /\ pc[s] \in {"acquire", "map", "awake", "refused", "failed"}
          /\ next[s] \in 1..(Len(Alloc(s)) + 1)
          /\ mapped[s] \in Nat /\ budget[s] \in Nat /\ waiting[s] \in BOOLEAN
          /\ tags[s] \in {"asleep", "awake"} /\ host[s] \in 0..Size(s)

Capacity == Used <= Cap

NoOOMFailure == \A s \in Incoming : pc[s] # "failed"

(* A refused wake leaves the stage as before it: nothing of this wake mapped, tags asleep,
   its host copy whole (the next wake restores from it). *)
RefusedExact == \A s \in Incoming :
    pc[s] = "refused" => mapped[s] = 0 /\ tags[s] = "asleep" /\ host[s] = Size(s)

BudgetB == \A s \in Incoming : mapped[s] <= Size(s)

AwakeComplete == \A s \in Incoming : pc[s] = "awake" => mapped[s] = Size(s) /\ tags[s] = "awake"

(* A's sleep is an ordinary Sleep: asleep means it holds nothing. *)
AExact == pcA = "asleep" => a = 0

(* Waking: tags asleep until the last allocation is mapped. *)
AsleepUntilComplete == \A s \in Incoming : tags[s] = "awake" => pc[s] = "awake"

(* Two incoming stages B and C racing for what A frees, each small enough to fit alone:
   each keeps what it mapped while it waits for the rest (hold and wait), so both may wait
   with neither able to finish. The first wait to expire rolls back and lets the other
   through, so one of them wakes, if the waits outlast A's sleep and a poll after the
   rollback (LongWait). Otherwise both may be refused: TLC finds it at once without
   LongWait, and two deadlines that pass within one poll of each other do it on a real
   device. Checked with and without LongWait by tests/formal/test_swap.py. So the engine
   admits one incoming wake per device at a time (OneIncoming): C's wake starts once B's has
   ended, and one of them wakes whenever the waits outlast A's sleep, however close their
   deadlines (WaitOutlastsA, no poll needed): models/swap_two_serial.cfg holds it as an
   invariant, bugs/swap_two_incoming.cfg (C issued while B waits) violates it. *)
NotBothRefused == ~(\A s \in Incoming : pc[s] = "refused")

SwapEnds == <>(pcA \in {"asleep", "failed"} /\ \A s \in Incoming : pc[s] \in {"awake", "refused"})

(* A keeping its memory until its last copy never makes an incoming stage wait for it: with
   no third process moving, the room A saw for B at the start stays B's. *)
LateNeverBlocks == Late /\ pcA \in {"kv", "copying"} => \A s \in Incoming : ~waiting[s]

(* Under: A does not fail, no deadline passes, and OtherMax + Reserve + every incoming
   stage's size <= Cap (whatever the third process ends up holding, the rest fits). *)
SwapSucceeds == <>(pcA = "asleep" /\ \A s \in Incoming : pc[s] = "awake")
=============================================================================
