----------------------------- MODULE OmniAdmission -----------------------------
(***************************************************************************)
(* The admission queue of a stage (StageCore.on_submit and _pump), on top *)
(* of the protocol spec OmniSleep. A request arriving at the stage is run, *)
(* queued or refused as the GENERATED table Admission says for the stage's *)
(* state and policy (fsm/admission.py's ADMISSION); the queue moves as    *)
(* QueueRules says (QUEUE_RULES): dispatch in RUNNING up to MaxRequests   *)
(* in flight, hold while a task is under way, wake a sleeping stage under *)
(* the policy "wake", refuse everything in NEEDS_RELOAD, FAILED, STOPPED. *)
(* What this module writes by hand is what the tables leave to the core:  *)
(* the order (a request runs at once only if the queue is empty), the     *)
(* bound (QueueLimit: a full queue refuses), the queue's own deadline     *)
(* and the pump running right after each stage step.                      *)
(*                                                                         *)
(* StageCore runs _pump inside every step; here the pump is a step of its *)
(* own that comes before any other step of the stage (PumpDue blocks      *)
(* them): the ranks and the network are other processes, so their steps   *)
(* may fall in between, as they may after the stage's combined step.      *)
(*                                                                         *)
(* Every request keeps its outcome "pending" while queued or in flight and *)
(* ends "ok", "failed" or "refused": none is lost (Adm_NoRequestLost).     *)
(***************************************************************************)
EXTENDS OmniSleep, Sequences

CONSTANTS
    Policies,       \* SUBSET AdmissionPolicies: the policies the stage may be set to (SetAdmission)
    QueueLimit      \* StageCore.queue_limit: a request that finds the queue this long is refused

ASSUME Policies \subseteq AdmissionPolicies /\ Policies # {}
ASSUME QueueLimit \in Nat
ASSUME ~Requests    \* requests come through Submit here, not OmniSleep's IssueExecute

VARIABLES
    squeue,         \* the queued requests' task ids, oldest first
    spolicy,        \* the stage's admission policy now
    submitted       \* history: every request task id the callers submitted

admVars == <<squeue, spolicy, submitted>>
allVars == <<vars, admVars>>

QSet == {squeue[i] : i \in 1..Len(squeue)}
Decision == (CHOOSE a \in Admission : a[1] = sstate /\ a[2] = spolicy)[3]
QueueAction == (CHOOSE q \in QueueRules : q[1] = sstate /\ q[2] = spolicy)[3]
Refusal == {"refuse_policy", "refuse_needs_reload", "refuse_failed"}
RefuseRequest(t) ==     \* the caller says what becomes of the queue
    /\ outcome' = [outcome EXCEPT ![t] = "refused"]
    /\ UNCHANGED <<workerVars, sstate, sepoch, stask, scmd, sacks, sloadFailed, sasleep,
                   svalid, sreqs, sreqReplies, sreqErr, failedRanks, sprof, net, faults, broken>>

(* StageCore.on_submit: run now only if the table says run, there is room in flight and no
   request waits before it; else a refusal of the table, a full queue, or the queue. *)
Submit ==
    /\ nextTask \in TaskIds
    /\ LET t == nextTask IN
       /\ submitted' = submitted \cup {t}
       /\ nextTask' = nextTask + 1
       /\ IF Decision = "run" /\ Cardinality(sreqs) < MaxRequests /\ squeue = <<>>
          THEN Dispatch(t) /\ UNCHANGED squeue
          ELSE IF Decision \in Refusal THEN RefuseRequest(t) /\ UNCHANGED squeue
          ELSE IF Len(squeue) >= QueueLimit /\ Bug # "queue_unbounded" THEN RefuseRequest(t) /\ UNCHANGED squeue
          ELSE /\ squeue' = Append(squeue, t)
               /\ outcome' = Pending(t)
               /\ UNCHANGED <<workerVars, sstate, sepoch, stask, scmd, sacks, sloadFailed, sasleep,
                              svalid, sreqs, sreqReplies, sreqErr, failedRanks, sprof, net, faults,
                              broken>>
    /\ UNCHANGED spolicy

(* StageCore.on_set_admission: the policy may change at any time; queued requests stay. *)
SetPolicy(p) ==
    /\ p # spolicy /\ spolicy' = p
    /\ UNCHANGED <<vars, squeue, submitted>>

(* A queued request's own deadline (StageCore.on_tick): it leaves the queue refused. *)
QueueExpired ==
    /\ "timeout" \in Faults
    /\ \E i \in 1..Len(squeue) :
       /\ squeue' = SubSeq(squeue, 1, i - 1) \o SubSeq(squeue, i + 1, Len(squeue))
       /\ RefuseRequest(squeue[i])
    /\ UNCHANGED <<nextTask, spolicy, submitted>>

(* ---- StageCore._pump: what QueueRules says for (state, policy), while it has work. *)
DispatchDue == QueueAction = "dispatch" /\ squeue # <<>> /\ Cardinality(sreqs) < MaxRequests
AutoWakeDue == QueueAction = "auto_wake" /\ squeue # <<>> /\ Idle /\ nextTask \in TaskIds
RejectDue == QueueAction = "reject_all" /\ squeue # <<>>
PumpDue == DispatchDue \/ AutoWakeDue \/ RejectDue

DispatchQueued ==
    /\ DispatchDue
    /\ Dispatch(Head(squeue))
    /\ squeue' = IF Bug = "queue_dropped_on_wake" THEN <<>> ELSE Tail(squeue)
    /\ UNCHANGED <<nextTask, spolicy, submitted>>

(* The wake the policy "wake" starts: every tag, a task id of its own, as a caller's wake. *)
AutoWake ==
    /\ AutoWakeDue
    /\ IssueWake(Tags)
    /\ UNCHANGED admVars

RejectQueued ==
    /\ RejectDue \/ (Bug = "queue_refused_anywhere" /\ squeue # <<>>)
    /\ outcome' = [t \in TaskIds |-> IF t \in QSet THEN "refused" ELSE outcome[t]]
    /\ squeue' = <<>>
    /\ UNCHANGED <<workerVars, sstate, sepoch, stask, scmd, sacks, sloadFailed, sasleep, svalid, sreqs,
                   sreqReplies, sreqErr, failedRanks, sprof, nextTask, net, faults, broken,
                   spolicy, submitted>>

Pump == DispatchQueued \/ AutoWake \/ RejectQueued

AdmInit ==
    /\ Init
    /\ squeue = <<>>
    /\ spolicy \in Policies
    /\ submitted = {}

AdmNext ==
    \/ PumpDue /\ Pump
    \/ ~PumpDue /\ \/ StageCall /\ UNCHANGED admVars
                   \/ RestartWith(QSet) /\ squeue' = <<>> /\ UNCHANGED <<spolicy, submitted>>
                   \/ Submit
                   \/ QueueExpired
                   \/ \E p \in Policies : SetPolicy(p)
    \/ ProcessStep /\ UNCHANGED admVars

AdmSpec == AdmInit /\ [][AdmNext]_allVars

-----------------------------------------------------------------------------
(* ============================== invariants ============================== *)

AdmTypeOK ==
    /\ squeue \in Seq(TaskIds) /\ spolicy \in Policies /\ submitted \subseteq TaskIds

(* A full queue refuses: it never holds more than QueueLimit requests. *)
Adm_QueueBounded == Len(squeue) <= QueueLimit

(* None is lost: every submitted request is answered, or waits in exactly one place (the
   queue, once, or in flight); and nothing else waits there. *)
Adm_NoRequestLost ==
    /\ \A t \in submitted :
         /\ outcome[t] # "none"
         /\ (outcome[t] = "pending") <=> (t \in QSet \/ t \in sreqs)
         /\ ~(t \in QSet /\ t \in sreqs)
    /\ QSet \cup sreqs \subseteq submitted
    /\ Len(squeue) = Cardinality(QSet)

(* Once the pump has run, nothing waits where nothing can run: not in NEEDS_RELOAD, FAILED or
   STOPPED (they refuse the queue), not in RUNNING with room in flight. *)
Adm_QueueOnlyWhileWaiting ==
    ~PumpDue /\ squeue # <<>> =>
        /\ sstate \notin {"NEEDS_RELOAD", "FAILED", "STOPPED"}
        /\ sstate = "RUNNING" => Cardinality(sreqs) = MaxRequests

(* A request joins the queue only where it may still run, written here and not taken from the
   generated tables, so that a changed Admission or QueueRules row breaks it: never in
   NEEDS_RELOAD (the weights are gone until a reload: refused at once, P-8), FAILED or STOPPED
   (nothing runs before a restart), and under the policy reject only in RUNNING (waiting for
   room in flight). A row that queues there and lets the pump refuse it a step later answers
   the caller with the wrong reason, late. *)
Adm_JoinsQueueOnlyWhereItMayRun ==
    [][Len(squeue') > Len(squeue) =>
           /\ sstate \notin {"NEEDS_RELOAD", "FAILED", "STOPPED"}
           /\ spolicy = "reject" => sstate = "RUNNING"]_allVars

(* A queued request leaves the queue refused only where a rule refuses it: QueueRules says
   reject_all for the state and policy, its own deadline passed (it alone leaves), or the
   stage restarted (a new epoch refuses the queue). Not where the pump should dispatch. *)
Adm_QueueRefusedOnlyByARule ==
    [][\A t \in QSet :
         outcome'[t] = "refused" =>
             \/ QueueAction = "reject_all"
             \/ "timeout" \in Faults /\ QSet' = QSet \ {t}
             \/ sepoch' # sepoch]_allVars

=============================================================================
