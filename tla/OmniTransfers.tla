---------------------------- MODULE OmniTransfers ----------------------------
(***************************************************************************)
(* A stage-to-stage transfer under the lifecycle (P-22): one request's     *)
(* intermediate exported by a producer stage (TransferOut: buckets its     *)
(* ranks hold), admitted at a consumer stage by the consumer's admission   *)
(* rules, landed there (TransferIn), run on, and released (TransferRelease) *)
(* while both stages sleep, wake, pause, update and die around it.         *)
(*                                                                         *)
(* Every move of the transfer comes from the GENERATED rows of             *)
(* TransferTable (omni_core/fsm/transfers.py: TRANSFER_TRANSITIONS, and    *)
(* LandRows: where a held transfer goes by the consumer's state and        *)
(* policy, read from fsm/admission.py). The stages are abstract: a         *)
(* producer RUNNING or SLEEPING at a weights version, which refuses a      *)
(* sleep or an update while it holds an export (StageCore.transfers); a    *)
(* consumer RUNNING, SLEEPING, PAUSED or FAILED, whose own rows take a     *)
(* TransferIn and run a request only while RUNNING.                        *)
(*                                                                         *)
(* Checked: the producer is awake and at the export's version while it     *)
(* holds it (ProducerHoldsItsExport); the consumer's request runs only on  *)
(* a RUNNING consumer (RunsOnRunningConsumer) and only on the version it   *)
(* was declared for (RunsOnDeclaredVersion); a transfer wakes only a       *)
(* sleeping consumer, never a paused one (WakesOnlyTheSleeping); the       *)
(* request is answered at most once and, once the transfer is done,        *)
(* exactly once with the producer's buckets released (AnsweredOnce,        *)
(* DoneIsReleased).                                                        *)
(*                                                                         *)
(* Bug models (tla/bugs/transfer_*.cfg), each caught:                      *)
(*   transfer_sleep_with_hold  the producer sleeps while its export is     *)
(*                   held (ProducerHoldsItsExport)                         *)
(*   transfer_update_with_hold the producer takes an update while its      *)
(*                   export is held (ProducerHoldsItsExport)               *)
(*   transfer_lands_anywhere   the consumer takes the TransferIn and runs  *)
(*                   the request in any state (RunsOnRunningConsumer)      *)
(*   transfer_wakes_paused     a paused consumer is woken for the transfer *)
(*                   (WakesOnlyTheSleeping)                                *)
(*   transfer_no_version_check a request declared for another producer    *)
(*                   version runs (RunsOnDeclaredVersion)                  *)
(*   transfer_death_unreleased a consumer that dies fails the request but  *)
(*                   the producer's buckets are never released             *)
(*                   (DoneIsReleased)                                      *)
(***************************************************************************)
EXTENDS Integers, TransferTable

CONSTANTS
    MaxVersion,   \* the producer's updates: versions 0..MaxVersion
    Policies,     \* the consumer's admission policies explored
    Bug

VARIABLES
    pstate,       \* the producer stage: "RUNNING" or "SLEEPING"
    pversion,     \* its weights version
    held,         \* StageCore.transfers: the producer's ranks hold the export
    buckets,      \* the export's buckets exist in the producer's ranks' memory
    xstate,       \* the transfer (TransferCore.state)
    xversion,     \* the version the export was computed at; -1: none yet
    expect,       \* the version the request was declared for; -1: any
    cstate,       \* the consumer stage: "RUNNING", "SLEEPING", "PAUSED" or "FAILED"
    policy,       \* its admission policy
    ranIn,        \* the consumer's state when the request ran; "none": not run
    ranVersion,   \* the export's version the request ran on; -1: not run
    wokeFrom,     \* the consumer's state when the transfer woke it; "none"
    answers       \* answers the request got

vars == <<pstate, pversion, held, buckets, xstate, xversion, expect, cstate, policy, ranIn, ranVersion,
          wokeFrom, answers>>

Row(s, t) == \E r \in TransferRows : r[1] = s /\ r[2] = t
Next_(s, t) == CHOOSE n \in {r[3] : r \in {q \in TransferRows : q[1] = s /\ q[2] = t}} : TRUE
Fire(t) == /\ Row(xstate, t) /\ xstate' = Next_(xstate, t)
LandOf(s, p) ==
    IF Bug = "transfer_wakes_paused" /\ s = "PAUSED" /\ p = "wake" THEN "wake"
    ELSE CHOOSE a \in {r[3] : r \in {q \in LandRows : q[1] = s /\ q[2] = p}} : TRUE
Answer == answers' = answers + 1
Open == xstate \notin {"RELEASING", "DONE"}

Init ==
    /\ pstate = "RUNNING" /\ pversion = 0 /\ held = FALSE /\ buckets = FALSE
    /\ xstate = "NEW" /\ xversion = -1 /\ expect \in {-1} \cup (0..MaxVersion)  \* any version, or one
    /\ cstate \in {"RUNNING", "SLEEPING", "PAUSED"} /\ policy \in Policies
    /\ ranIn = "none" /\ ranVersion = -1 /\ wokeFrom = "none" /\ answers = 0

---------------------------------------------------------------------------
(* The producer's lifecycle: StageCore refuses a sleep and an update while a transfer is held. *)
ProducerSleep ==
    /\ pstate = "RUNNING" /\ (~held \/ Bug = "transfer_sleep_with_hold")
    /\ pstate' = "SLEEPING"
    /\ UNCHANGED <<pversion, held, buckets, xstate, xversion, expect, cstate, policy, ranIn, ranVersion, wokeFrom, answers>>
ProducerWake ==
    /\ pstate = "SLEEPING" /\ pstate' = "RUNNING"
    /\ UNCHANGED <<pversion, held, buckets, xstate, xversion, expect, cstate, policy, ranIn, ranVersion, wokeFrom, answers>>
ProducerUpdate ==
    /\ pstate = "RUNNING" /\ pversion < MaxVersion /\ (~held \/ Bug = "transfer_update_with_hold")
    /\ pversion' = pversion + 1
    /\ UNCHANGED <<pstate, held, buckets, xstate, xversion, expect, cstate, policy, ranIn, ranVersion, wokeFrom, answers>>

(* The consumer's callers: sleep, wake, pause, resume; and its ranks die. *)
ConsumerMoves ==
    /\ \/ cstate = "RUNNING" /\ cstate' \in {"SLEEPING", "PAUSED", "FAILED"}
       \/ cstate = "SLEEPING" /\ cstate' \in {"RUNNING", "FAILED"}
       \/ cstate = "PAUSED" /\ cstate' \in {"RUNNING", "FAILED"}
    /\ UNCHANGED <<pstate, pversion, held, buckets, xstate, xversion, expect, policy, ranIn, ranVersion, wokeFrom, answers>>

---------------------------------------------------------------------------
(* The transfer, by its table. *)
Offer ==
    /\ Fire("offer")
    /\ UNCHANGED <<pstate, pversion, held, buckets, xversion, expect, cstate, policy, ranIn, ranVersion, wokeFrom, answers>>

(* Every producer rank ACKed the TransferOut (legal only while RUNNING): held at its version;
   a request declared for another version is refused here, answered and released. *)
Offered ==
    /\ pstate = "RUNNING" /\ xstate = "OFFERING"
    /\ held' = TRUE /\ buckets' = TRUE /\ xversion' = pversion
    /\ IF expect # -1 /\ expect # pversion /\ Bug # "transfer_no_version_check"
       THEN Fire("version_refused") /\ Answer
       ELSE Fire("offered") /\ UNCHANGED answers
    /\ UNCHANGED <<pstate, pversion, expect, cstate, policy, ranIn, ranVersion, wokeFrom>>

OfferRefused ==
    /\ Fire("offer_refused") /\ Answer
    /\ UNCHANGED <<pstate, pversion, held, buckets, xversion, expect, cstate, policy, ranIn, ranVersion, wokeFrom>>

(* Where a held or queued transfer goes: the consumer's admission (LandRows). *)
Decide ==
    /\ xstate \in {"HELD", "QUEUED"}
    /\ LET land == LandOf(cstate, policy) IN
       /\ ~(land = "queue" /\ xstate = "QUEUED")
       /\ Fire(land)
       /\ IF land = "refuse" THEN Answer ELSE UNCHANGED answers
    /\ UNCHANGED <<pstate, pversion, held, buckets, xversion, expect, cstate, policy, ranIn, ranVersion, wokeFrom>>

(* The policy's wake (Engine.wake of the consumer): it wakes a sleeping stage (one running or
   paused is ALREADY awake: nothing changes); a refused wake (a FAILED consumer) is the
   request's refusal. *)
WakeConsumer ==
    /\ xstate = "WAKING"
    /\ IF cstate = "FAILED"
       THEN Fire("refuse") /\ Answer /\ UNCHANGED <<cstate, wokeFrom>>
       ELSE /\ Fire("woke") /\ UNCHANGED answers
            /\ IF cstate = "SLEEPING" \/ (cstate = "PAUSED" /\ Bug = "transfer_wakes_paused")
               THEN cstate' = "RUNNING" /\ wokeFrom' = cstate
               ELSE UNCHANGED <<cstate, wokeFrom>>  \* a wake of a RUNNING or PAUSED stage: ALREADY
    /\ UNCHANGED <<pstate, pversion, held, buckets, xversion, expect, policy, ranIn, ranVersion>>

(* The consumer's stage takes the TransferIn only while RUNNING (its transfer_in row). *)
Landed ==
    /\ xstate = "LANDING" /\ (cstate = "RUNNING" \/ Bug = "transfer_lands_anywhere") /\ cstate # "FAILED"
    /\ Fire("landed")
    /\ UNCHANGED <<pstate, pversion, held, buckets, xversion, expect, cstate, policy, ranIn, ranVersion, wokeFrom, answers>>
LandRefused ==
    /\ xstate = "LANDING" /\ cstate # "RUNNING" /\ (Bug # "transfer_lands_anywhere" \/ cstate = "FAILED")
    /\ Fire("land_failed") /\ Answer
    /\ UNCHANGED <<pstate, pversion, held, buckets, xversion, expect, cstate, policy, ranIn, ranVersion, wokeFrom>>

(* The consumer's request runs on what landed (a request is admitted only while RUNNING); a
   consumer that died fails it, once. *)
Run ==
    /\ xstate = "RUNNING" /\ (cstate = "RUNNING" \/ (Bug = "transfer_lands_anywhere" /\ cstate # "FAILED"))
    /\ Fire("answered") /\ Answer
    /\ ranIn' = cstate /\ ranVersion' = xversion
    /\ UNCHANGED <<pstate, pversion, held, buckets, xversion, expect, cstate, policy, wokeFrom>>
Died ==
    /\ xstate = "RUNNING" /\ cstate = "FAILED"
    /\ Answer
    /\ IF Bug = "transfer_death_unreleased"
       THEN xstate' = "DONE"
       ELSE Fire("answered")
    /\ UNCHANGED <<pstate, pversion, held, buckets, xversion, expect, cstate, policy, ranIn, ranVersion, wokeFrom>>

(* The request's deadline: abandoned from any open state, answered. *)
Expire ==
    /\ xstate \notin {"NEW", "RELEASING", "DONE"}
    /\ Fire("expired") /\ Answer
    /\ UNCHANGED <<pstate, pversion, held, buckets, xversion, expect, cstate, policy, ranIn, ranVersion, wokeFrom>>

(* Every producer rank dropped its buckets (TransferRelease): the hold ends. *)
Released ==
    /\ Fire("released")
    /\ held' = FALSE /\ buckets' = FALSE
    /\ UNCHANGED <<pstate, pversion, xversion, expect, cstate, policy, ranIn, ranVersion, wokeFrom, answers>>

Next ==
    \/ ProducerSleep \/ ProducerWake \/ ProducerUpdate \/ ConsumerMoves
    \/ Offer \/ Offered \/ OfferRefused \/ Decide \/ WakeConsumer \/ Landed \/ LandRefused
    \/ Run \/ Died \/ Expire \/ Released

Spec == Init /\ [][Next]_vars

---------------------------------------------------------------------------
TypeOK ==
    /\ pstate \in {"RUNNING", "SLEEPING"} /\ pversion \in 0..MaxVersion
    /\ held \in BOOLEAN /\ buckets \in BOOLEAN
    /\ xstate \in {r[1] : r \in TransferRows} \cup {r[3] : r \in TransferRows}
    /\ cstate \in {"RUNNING", "SLEEPING", "PAUSED", "FAILED"} /\ answers \in 0..2

ProducerHoldsItsExport == held => (pstate = "RUNNING" /\ pversion = xversion)
RunsOnRunningConsumer == ranIn \in {"none", "RUNNING"}
RunsOnDeclaredVersion == ranVersion # -1 => (expect = -1 \/ ranVersion = expect)
WakesOnlyTheSleeping == wokeFrom \in {"none", "SLEEPING"}
AnsweredOnce == answers <= 1
DoneIsReleased == xstate = "DONE" => (answers = 1 /\ ~held /\ ~buckets)
=============================================================================
