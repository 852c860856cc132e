---------------------------- MODULE OmniAgreeRanks ----------------------------
(***************************************************************************)
(* Agreement over replies at two ranks, printed for formal/agree_ranks.py  *)
(* to replay on StageCore. Each initial state is one case: a settled stage *)
(* of two ranks at epoch 2, one lifecycle call (a Sleep from RUNNING, a    *)
(* Wake from SLEEPING, a Wake that may wait for memory), and a short       *)
(* sequence of replies, each from one rank: a well-formed ACK, an ACK with *)
(* the wrong asleep tags, an ACK naming the wrong state, a well-formed ACK *)
(* of another epoch (rank 0 an older one, rank 1 a newer one), the rank's  *)
(* previous reply again, or its refusal (NO_MEMORY to a Wake, BUSY to a    *)
(* Sleep). The call is issued with the spec's IssueSleep/IssueWake and     *)
(* every reply taken with StageReceive, in order; after each step the      *)
(* stage's state, failed ranks, the task's outcome, its residency and the  *)
(* ranks that have answered are printed. Nothing here restates the spec.   *)
(***************************************************************************)
EXTENDS OmniSleep, Sequences

CONSTANTS MaxReplies   \* the longest reply sequence

VARIABLES
    case,   \* [call |-> "Sleep" | "Wake", wait |-> BOOLEAN, seq |-> <<<<rank, kind>>, ...>>]
    pos     \* replies taken so far (0: the call not yet issued)

StageEpoch == 2
Kinds == {"ok", "tags", "state", "epoch", "dup", "nack"}
Choices == Ranks \X Kinds
Min(S) == CHOOSE x \in S : \A y \in S : x <= y
(* A duplicate repeats the rank's previous reply: it needs one. *)
DupOk(s) == \A i \in 1..Len(s) : s[i][2] = "dup" => \E j \in 1..(i - 1) : s[j][1] = s[i][1] /\ s[j][2] # "dup"
Seqs == {s \in UNION {[1..n -> Choices] : n \in 1..MaxReplies} : DupOk(s)}
Calls == {[call |-> "Sleep", wait |-> FALSE], [call |-> "Wake", wait |-> FALSE], [call |-> "Wake", wait |-> TRUE]}

(* What a well-formed ACK names: the settled state and tags the call leads to. *)
GoodState(c) == IF c.call = "Sleep" THEN "SLEEPING" ELSE "ACTIVE"
GoodAsleep(c) == IF c.call = "Sleep" THEN Tags ELSE {}
Before(c) == IF c.call = "Sleep" THEN "RUNNING" ELSE "SLEEPING"
(* The reply a kind stands for; a duplicate is the last non-duplicate reply of its rank. *)
Resolve(c, s, i) ==
    LET r == s[i][1]
        k == IF s[i][2] # "dup" THEN s[i][2]
             ELSE s[CHOOSE j \in 1..(i - 1) : s[j][1] = r /\ s[j][2] # "dup"
                      /\ \A l \in (j + 1)..(i - 1) : s[l][1] = r => s[l][2] = "dup"][2]
        ack(st, a, e) == AckMsg(c.call, 1, e, r, st, a, "OK")
    IN CASE k = "ok" -> ack(GoodState(c), GoodAsleep(c), StageEpoch)
         [] k = "tags" -> ack(GoodState(c), Tags \ GoodAsleep(c), StageEpoch)
         [] k = "state" -> ack(IF c.call = "Sleep" THEN "PARTIAL" ELSE "SLEEPING", GoodAsleep(c), StageEpoch)
         [] k = "epoch" -> ack(GoodState(c), GoodAsleep(c), IF r = Min(Ranks) THEN StageEpoch - 1 ELSE StageEpoch + 1)
         [] k = "nack" -> NackMsg(c.call, 1, StageEpoch, r, IF c.call = "Wake" THEN "NO_MEMORY" ELSE "BUSY", Before(c))


RanksInit(c) ==
    LET asl == IF c.call = "Sleep" THEN {} ELSE Tags
        ws == IF c.call = "Sleep" THEN "ACTIVE" ELSE "SLEEPING"
    IN /\ mem = [r \in Ranks |-> MemFrom(asl, TRUE)]
       /\ wstate = [r \in Ranks |-> ws] /\ alive = [r \in Ranks |-> TRUE]
       /\ wasleep = [r \in Ranks |-> asl] /\ wvalid = [r \in Ranks |-> TRUE] /\ wepoch = [r \in Ranks |-> StageEpoch]
       /\ wpend = [r \in Ranks |-> NoPend] /\ wcache = [r \in Ranks |-> {}]
       /\ replied = [r \in Ranks |-> {}] /\ applied = [r \in Ranks |-> [t \in TaskIds |-> 0]]
       /\ sstate = Before(c) /\ sepoch = StageEpoch /\ stask = 0 /\ scmd = NoCmd /\ sacks = Ranks
       /\ sloadFailed = {} /\ sasleep = asl /\ svalid = TRUE /\ sreqs = {} /\ sreqReplies = NoReplies
       /\ sreqErr = NoErrors /\ failedRanks = {} /\ outcome = [t \in TaskIds |-> "none"] /\ nextTask = 1
       /\ net = {} /\ faults = 0 /\ broken = {}
       /\ wprof = [r \in Ranks |-> FALSE] /\ sprof = NoProf

RanksAgreeInit == \E c \in Calls, s \in Seqs : case = [call |-> c.call, wait |-> c.wait, seq |-> s] /\ pos = 0 /\ RanksInit(c)

RanksAgreeNext ==
    \/ /\ pos = 0 /\ pos' = 1 /\ UNCHANGED case
       /\ IF case.call = "Sleep" THEN IssueSleep(1, Tags)
          ELSE IssueWake(Tags) /\ (scmd'.level > 0) = case.wait
    \/ /\ pos > 0 /\ pos <= Len(case.seq) /\ pos' = pos + 1 /\ UNCHANGED case
       /\ StageReceive(Resolve(case, case.seq, pos), FALSE)

(* Each step a result (an action constraint sees every transition). *)
PrintRankSteps ==
    PrintT(<<"AGREE2", <<case.call, case.wait>>, case.seq, pos',
             <<sstate', failedRanks', outcome'[1], sasleep', svalid', sacks', sprof'.nacks>>>>)
=============================================================================
