------------------------------- MODULE OmniMemory -------------------------------
(***************************************************************************)
(* What device memory may do, per rank and tag, whatever the protocol: the *)
(* abstract spec that OmniSleep refines (OmniSleep!MemoryRefined maps its  *)
(* ghost `mem` here). Values: "valid" (mapped, usable), "host" (unmapped,  *)
(* valid host copy), "lost" (unmapped, no copy), "garbage" (mapped, weights *)
(* without model values), "gone" (the process died).                      *)
(*                                                                         *)
(* The two rules P-7 and P-8 reduce to: memory moves only while no request *)
(* runs, and a request starts only on memory that is all mapped with valid *)
(* weights. Discarded weights come back only as garbage, until a reload or *)
(* a fresh process writes them.                                            *)
(***************************************************************************)
EXTENDS FiniteSets

CONSTANTS Ranks, Tags
VARIABLES mem, running

Weights == "weights"
Content == {"valid", "host", "lost", "garbage", "gone"}

(* One tag's move under one memory effect of its rank. *)
Moves(t) ==
    {<<"valid", "host">>, <<"valid", "lost">>, <<"garbage", "lost">>, <<"host", "valid">>,
     <<"garbage", "valid">>}                           \* offload, discard, restore, reload
    \cup (IF t = Weights THEN {<<"lost", "garbage">>}  \* discarded weights map back as garbage
          ELSE {<<"lost", "valid">>})                  \* scratch is usable once mapped
MayMove(t, a, b) == a = b \/ <<a, b>> \in Moves(t)
Usable(q) == \A t \in Tags : mem[q][t] \in {"valid", "gone"}

Init == mem = [r \in Ranks |-> [t \in Tags |-> "valid"]] /\ running = {}

Effect(r) ==     \* a sleep, wake or reload of rank r: only while no request runs
    /\ running = {} /\ mem[r][Weights] # "gone"
    /\ \E new \in [Tags -> Content] :
          /\ \A t \in Tags : MayMove(t, mem[r][t], new[t])
          /\ mem' = [mem EXCEPT ![r] = new]
    /\ UNCHANGED running
Begin(r) == r \notin running /\ \A q \in Ranks : Usable(q)    \* P-7, P-8
            /\ running' = running \cup {r} /\ UNCHANGED mem
End(r) == r \in running /\ running' = running \ {r} /\ UNCHANGED mem
Die(r) == mem' = [mem EXCEPT ![r] = [t \in Tags |-> "gone"]] /\ running' = running \ {r}
Fresh == mem' = [r \in Ranks |-> [t \in Tags |-> "valid"]] /\ running' = {}   \* restart: new processes

Next == \/ \E r \in Ranks : Effect(r) \/ Begin(r) \/ End(r) \/ Die(r)
        \/ Fresh

Spec == Init /\ [][Next]_<<mem, running>>
=============================================================================
