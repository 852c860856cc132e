------------------------------- MODULE OmniPause -------------------------------
(***************************************************************************)
(* The PAUSED lifecycle of a stage (vLLM's pause / resume), on top of the  *)
(* admission queue (OmniAdmission). A pause closes a RUNNING stage's       *)
(* admission and keeps its memory: in-flight requests drain first          *)
(* (pause_drain, as a sleep's drain: an Execute cannot be frozen on a      *)
(* rank), then the stage is PAUSED (pause_drained) with nothing sent to    *)
(* the ranks; a resume makes it RUNNING and the pump serves the queue. A   *)
(* pause holds until resume (spaused): a PAUSED stage may sleep (no drain) *)
(* and a wake (a caller's, or the one the policy "wake" starts for a       *)
(* queued request) or a reload brings it back PAUSED (woke_paused), the    *)
(* queue still held; a resume while it sleeps ends the pause there          *)
(* (resume_asleep), a restart starts afresh. Every legality and next state *)
(* comes from the GENERATED tables: the stage rows pause_drain,            *)
(* pause_drained, pause_already, resume, resume_already, resume_asleep,    *)
(* woke_paused, and the admission and queue rows for PAUSED (queue or      *)
(* refuse; hold).                                                          *)
(*                                                                         *)
(* What a mode changes is who hears what first: under "abort" the callers  *)
(* of in-flight requests hear ABORTED at once, the stage still waits for   *)
(* the ranks' answers; "wait" and "keep" let the callers get the results.  *)
(* The stage does the same under all three, so one Pause action models it. *)
(*                                                                         *)
(* StageCore commits PAUSED in the step in which the last request ends;    *)
(* here that is a step of its own (PauseDrained) that comes before any     *)
(* other step of the stage, as the pump does in OmniAdmission. Likewise    *)
(* the commit of a held stage's wake: OmniSleep's Commit takes it to       *)
(* RUNNING and RePause, before any other step, makes that the core's one   *)
(* step WAKING -woke_paused-> PAUSED.                                      *)
(*                                                                         *)
(* Bug models (tla/bugs/pause_*.cfg):                                      *)
(*   pause_no_drain  the pause commits PAUSED at once, with requests still *)
(*                   in flight (Pause_NothingInFlightWhilePaused)          *)
(*   pause_admits    a request submitted to a PAUSED stage is sent to the  *)
(*                   ranks without asking the table                        *)
(*                   (Pause_NoRequestStartsWhilePaused)                    *)
(*   pause_wake_resumes  a wake of a stage paused before it slept makes it *)
(*                   RUNNING and serves the queue without a resume         *)
(*                   (Pause_HeldUntilResume, Pause_NoRequestStartsWhileHeld) *)
(***************************************************************************)
EXTENDS OmniAdmission

VARIABLE spaused    \* a pause holds until resume (StageCore.paused), asleep or not
pauseVars == <<allVars, spaused>>

PauseCmd == [type |-> "Pause", level |-> 0, tags |-> {}]
PauseInit == AdmInit /\ spaused = FALSE
PauseTask == stask # 0 /\ scmd.type = "Pause"

(* StageCore.pause: a RUNNING stage closes admission; with nothing in flight it is PAUSED in
   the same step. Already PAUSED: ALREADY, nothing changes. *)
IssuePause ==
    /\ Idle /\ nextTask \in TaskIds
    /\ LET t == nextTask IN
       \/ /\ SLegal(sstate, "pause_already")
          /\ sstate' = SNext(sstate, "pause_already")
          /\ outcome' = [outcome EXCEPT ![t] = "ok"]
          /\ UNCHANGED <<stask, scmd, spaused>>
       \/ /\ SLegal(sstate, "pause_drain")
          /\ IF sreqs = {} \/ Bug = "pause_no_drain"
             THEN /\ sstate' = SNext(SNext(sstate, "pause_drain"), "pause_drained")
                  /\ outcome' = [outcome EXCEPT ![t] = "ok"]
                  /\ spaused' = TRUE
                  /\ UNCHANGED <<stask, scmd>>
             ELSE /\ sstate' = SNext(sstate, "pause_drain")
                  /\ stask' = t /\ scmd' = PauseCmd
                  /\ outcome' = Pending(t)
                  /\ UNCHANGED spaused
    /\ nextTask' = nextTask + 1
    /\ UNCHANGED <<sepoch, sacks, sloadFailed, sasleep, svalid, sreqs, sreqReplies, sreqErr, failedRanks,
                   workerVars, net, faults, broken, sprof>>

(* The last request of a pause's drain ended (OmniSleep's EndRequest leaves a pause alone). *)
PauseDrainedDue == sstate = "DRAINING" /\ PauseTask /\ sreqs = {}
PauseDrained ==
    /\ PauseDrainedDue
    /\ sstate' = SNext(sstate, "pause_drained")
    /\ outcome' = [outcome EXCEPT ![stask] = "ok"]
    /\ stask' = 0 /\ scmd' = NoCmd
    /\ spaused' = TRUE
    /\ UNCHANGED <<sepoch, sacks, sloadFailed, sasleep, svalid, sreqs, sreqReplies, sreqErr, failedRanks,
                   workerVars, nextTask, net, faults, broken, sprof>>

(* StageCore.resume: PAUSED -> RUNNING, a RUNNING stage ALREADY; a stage paused before it
   slept stays asleep, the pause ends. Nothing is sent. *)
IssueResume ==
    /\ Idle /\ nextTask \in TaskIds
    /\ \/ SLegal(sstate, "resume") /\ sstate' = SNext(sstate, "resume")
       \/ SLegal(sstate, "resume_already") /\ sstate' = SNext(sstate, "resume_already")
       \/ spaused /\ SLegal(sstate, "resume_asleep") /\ sstate' = SNext(sstate, "resume_asleep")
    /\ spaused' = FALSE
    /\ outcome' = [outcome EXCEPT ![nextTask] = "ok"]
    /\ nextTask' = nextTask + 1
    /\ UNCHANGED <<sepoch, stask, scmd, sacks, sloadFailed, sasleep, svalid, sreqs, sreqReplies, sreqErr,
                   failedRanks, workerVars, net, faults, broken, sprof>>

(* Bug pause_admits: a shell that sends a request without asking the stage's table. *)
SubmitPastThePause ==
    /\ Bug = "pause_admits" /\ sstate = "PAUSED" /\ nextTask \in TaskIds /\ Cardinality(sreqs) < MaxRequests
    /\ LET t == nextTask IN
       /\ sreqs' = sreqs \cup {t}
       /\ net' = net \cup SendAll("Execute", t, 0, {})
       /\ outcome' = Pending(t)
       /\ submitted' = submitted \cup {t}
       /\ nextTask' = t + 1
    /\ UNCHANGED <<sstate, sepoch, stask, scmd, sacks, sloadFailed, sasleep, svalid, sreqReplies, sreqErr,
                   failedRanks, workerVars, faults, broken, sprof, squeue, spolicy>>

(* OmniSleep's Commit of a wake or a reload took a held stage to RUNNING; StageCore commits it
   PAUSED in that one step (woke_paused, WAKING -> PAUSED): this step, before any other. *)
RePauseDue == spaused /\ sstate = "RUNNING" /\ Bug # "pause_wake_resumes"
RePause ==
    /\ RePauseDue
    /\ sstate' = SNext("WAKING", "woke_paused")
    /\ UNCHANGED <<sepoch, stask, scmd, sacks, sloadFailed, sasleep, svalid, sreqs, sreqReplies, sreqErr,
                   failedRanks, workerVars, nextTask, net, faults, broken, sprof, outcome, admVars, spaused>>

(* A restart brings fresh ranks and a fresh stage: the pause ends with the epoch. *)
HoldAcross == spaused' = (spaused /\ sepoch' = sepoch)

PauseNext ==
    \/ RePause
    \/ ~RePauseDue /\ PauseDrainedDue /\ PauseDrained /\ UNCHANGED admVars
    \/ ~RePauseDue /\ PauseDrainedDue /\ ProcessStep /\ UNCHANGED admVars /\ HoldAcross
    \/ ~RePauseDue /\ ~PauseDrainedDue /\ AdmNext /\ HoldAcross
    \/ ~RePauseDue /\ ~PauseDrainedDue /\ ~PumpDue /\ (IssuePause \/ IssueResume) /\ UNCHANGED admVars
    \/ ~RePauseDue /\ ~PauseDrainedDue /\ ~PumpDue /\ SubmitPastThePause /\ UNCHANGED spaused

PauseSpec == PauseInit /\ [][PauseNext]_pauseVars

-----------------------------------------------------------------------------
(* ============================== invariants ============================== *)

(* A pause releases nothing: every tag resident and valid on every live rank, as in RUNNING. *)
Pause_MemoryKept ==
    sstate = "PAUSED" =>
        /\ sasleep = {} /\ svalid
        /\ \A r \in Ranks : Live(r) => wstate[r] = "ACTIVE" /\ \A x \in Tags : mem[r][x] = "valid"

(* PAUSED is committed only once no request is in flight (the drain came first). *)
Pause_NothingInFlightWhilePaused == sstate = "PAUSED" => sreqs = {}

(* No request starts while PAUSED: the set in flight never grows in a step from PAUSED. *)
Pause_NoRequestStartsWhilePaused == [][sstate = "PAUSED" => sreqs' \subseteq sreqs]_pauseVars

(* A pause holds until resume: a held stage is never RUNNING but for the one spec step in which
   its wake's commit is completed (RePause); a sleep and a wake do not end it. *)
Pause_HeldUntilResume == spaused /\ sstate = "RUNNING" => RePauseDue
Pause_HeldOnlyWherePaused == sstate = "PAUSED" => spaused

(* No request starts while a pause holds, asleep, waking or paused. *)
Pause_NoRequestStartsWhileHeld == [][spaused => sreqs' \subseteq sreqs]_pauseVars

(* Entering and leaving PAUSED puts nothing on the network: no rank hears of a pause. *)
Pause_NothingSent ==
    [][(sstate' = "PAUSED" /\ sstate # "PAUSED") \/ (sstate = "PAUSED" /\ sstate' = "RUNNING") => net' = net]_pauseVars
=============================================================================
