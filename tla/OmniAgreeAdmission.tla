-------------------------- MODULE OmniAgreeAdmission --------------------------
(***************************************************************************)
(* Agreement of StageCore's admission with OmniAdmission's hand-written    *)
(* part (formal/agree_admission.py): every stage state, policy, queue      *)
(* length (0..QueueLimit) and number in flight (0..MaxRequests, only where *)
(* requests can be in flight) is an initial state; TLC takes the one step  *)
(* OmniAdmission takes first there (the pump when it is due, else a Submit) *)
(* and prints the case and what the step did. The Python side puts        *)
(* StageCore in the same case and calls _pump or on_submit.                *)
(***************************************************************************)
EXTENDS OmniAdmission

VARIABLE stepped

ASSUME MaxTask >= QueueLimit + MaxRequests + 2    \* room for the queue, those in flight, one more

AsleepIn(s) == CASE s = "SLEEPING" -> Tags [] s = "PARTIAL" -> Tags \ {Weights} [] OTHER -> {}
InTaskStates == {"DRAINING", "TRANSITIONING", "WAKING"}   \* a lifecycle task is in flight (StageCoreInvariants)

AgreeInit ==
    \E s \in StageStates, p \in AdmissionPolicies, q \in 0..QueueLimit, n \in 0..MaxRequests :
    /\ n > 0 => s \in {"RUNNING", "DRAINING"}
    /\ mem = [r \in Ranks |-> FreshMem] /\ wstate = [r \in Ranks |-> "ACTIVE"] /\ alive = [r \in Ranks |-> TRUE]
    /\ wasleep = [r \in Ranks |-> {}] /\ wvalid = [r \in Ranks |-> TRUE] /\ wepoch = [r \in Ranks |-> 0]
    /\ wpend = [r \in Ranks |-> NoPend] /\ wprof = [r \in Ranks |-> FALSE] /\ wcache = [r \in Ranks |-> {}]
    /\ replied = [r \in Ranks |-> {}] /\ applied = [r \in Ranks |-> [t \in TaskIds |-> 0]]
    /\ sstate = s /\ sepoch = 0 /\ sacks = Ranks /\ sloadFailed = {}
    /\ stask = IF s \in InTaskStates THEN MaxTask ELSE 0
    /\ scmd = IF s \in InTaskStates THEN [type |-> "Sleep", level |-> 1, tags |-> Tags] ELSE NoCmd
    /\ sasleep = AsleepIn(s) /\ svalid = (s # "NEEDS_RELOAD")
    /\ sreqs = (q + 1)..(q + n) /\ sreqReplies = NoReplies /\ sreqErr = NoErrors
    /\ failedRanks = (IF s = "FAILED" THEN Ranks ELSE {}) /\ sprof = NoProf
    /\ outcome = [t \in TaskIds |-> IF t <= q + n THEN "pending" ELSE "none"]
    /\ nextTask = q + n + 1 /\ net = {} /\ faults = 0 /\ broken = {}
    /\ squeue = [i \in 1..q |-> i] /\ spolicy = p /\ submitted = 1..(q + n)
    /\ stepped = FALSE

AgreeNext ==
    /\ ~stepped /\ stepped' = TRUE
    /\ IF PumpDue THEN Pump ELSE Submit

Case == <<sstate, spolicy, Len(squeue), Cardinality(sreqs)>>
(* What the step did: the pump's action, or where the new request went. *)
Did ==
    IF PumpDue
    THEN IF Cardinality(sreqs') > Cardinality(sreqs) THEN "dispatch"
         ELSE IF stask' # stask THEN "auto_wake"
         ELSE IF squeue' = <<>> THEN "reject_all" ELSE "none"
    ELSE IF nextTask \in sreqs' THEN "run"
         ELSE IF nextTask \in {squeue'[i] : i \in 1..Len(squeue')} THEN "queue"
         ELSE IF outcome'[nextTask] = "refused" THEN "refuse" ELSE "none"

PrintCases == ~stepped => PrintT(<<"ADMIT", "case", Case>>)
PrintSteps == PrintT(<<"ADMIT", "step", Case, IF PumpDue THEN "pump" ELSE "submit", Did>>)
=============================================================================
