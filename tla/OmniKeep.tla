-------------------------------- MODULE OmniKeep --------------------------------
(***************************************************************************)
(* Pause mode keep: in-flight refit on a rank (WorkerCore, HoldRequests;   *)
(* fsm/version_spans.py). Requests generate one token per step under the   *)
(* rank's weights version. A hold freezes the batch where it is (each      *)
(* request's boundary: its tokens so far); an UpdateWeights may then run   *)
(* beside it (and only then: beside a running batch nothing else starts);  *)
(* the release lets the batch go on under the version held now, and a      *)
(* request whose version changed opens a span at its boundary. A hold with *)
(* clear_cache drops the KV instead: the request restarts from its prompt, *)
(* its tokens so far discarded. Each Result carries the spans.             *)
(*                                                                         *)
(* `truth` is a ghost: the version that really computed each token. What   *)
(* must hold: the spans a Result carries name, for every token, the        *)
(* version that computed it; no token is computed while a request is held  *)
(* or while an update writes the weights under it; a running request's     *)
(* last span is the version it runs under.                                 *)
(*                                                                         *)
(* Legality and next states of the rank come from the generated            *)
(* OmniTransitions (the tables). Bug models (tla/bugs/keep_*.cfg):         *)
(*   unrecorded_resume  the release lets a request go on under the new     *)
(*                      version without opening its span                   *)
(*                      (Keep_SpansTellTheTruth)                           *)
(*   step_while_held    the rank steps held requests (the shell's loop     *)
(*                      does not look at the hold): tokens after the       *)
(*                      boundary are the old version's                     *)
(*                      (Keep_SpansTellTheTruth)                           *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets, OmniTransitions

CONSTANTS
    Tasks,          \* request ids
    MaxTokens,      \* each request's output length
    MaxVersion,     \* updates go up to this version
    ClearCache,     \* TRUE: a hold may drop the KV (clear_cache)
    Bug             \* "none" | "unrecorded_resume" | "step_while_held"

ASSUME Bug \in {"none", "unrecorded_resume", "step_while_held"}
ASSUME MaxTokens \in Nat \ {0} /\ MaxVersion \in Nat /\ ClearCache \in BOOLEAN

VARIABLES
    wstate,     \* the rank's state (the table's)
    wv,         \* the weights version it holds
    updating,   \* an UpdateWeights is writing the weights (RELOADING)
    held,       \* HoldRequests(hold=TRUE) is in force
    running,    \* requests of the batch
    tokens,     \* request -> its output tokens so far
    truth,      \* request -> the version that computed each of its tokens (ghost)
    spans,      \* request -> its recorded spans: <<[v, start]>>, in token order
    boundary,   \* request -> its tokens when last held
    answered    \* request -> whether its Result went, the spans it carried, and the truth then

vars == <<wstate, wv, updating, held, running, tokens, truth, spans, boundary, answered>>

Span(v, s) == [v |-> v, start |-> s]

Init ==
    /\ wstate = WorkerNext(WorkerInitial, "loaded")
    /\ wv = 0
    /\ updating = FALSE
    /\ held = FALSE
    /\ running = {}
    /\ tokens = [t \in Tasks |-> 0]
    /\ truth = [t \in Tasks |-> <<>>]
    /\ spans = [t \in Tasks |-> <<>>]
    /\ boundary = [t \in Tasks |-> 0]
    /\ answered = [t \in Tasks |-> [done |-> FALSE, spans |-> <<>>, truth |-> <<>>]]

(* An Execute: a new request joins the batch (the core refuses it BUSY while held). *)
Submit(t) ==
    /\ ~answered[t].done /\ t \notin running /\ tokens[t] = 0
    /\ WorkerLegal(wstate, "execute") /\ ~held /\ ~updating
    /\ running' = running \cup {t}
    /\ spans' = [spans EXCEPT ![t] = <<Span(wv, 0)>>]
    /\ UNCHANGED <<wstate, wv, updating, held, tokens, truth, boundary, answered>>

(* One step of the runner: a token under the weights held now. *)
Step(t) ==
    /\ t \in running /\ tokens[t] < MaxTokens
    /\ ~updating
    /\ ~held \/ Bug = "step_while_held"
    /\ tokens' = [tokens EXCEPT ![t] = @ + 1]
    /\ truth' = [truth EXCEPT ![t] = Append(@, wv)]
    /\ UNCHANGED <<wstate, wv, updating, held, running, spans, boundary, answered>>

(* The request finished: its Result carries its spans. *)
Finish(t) ==
    /\ t \in running /\ tokens[t] = MaxTokens /\ ~held
    /\ running' = running \ {t}
    /\ answered' = [answered EXCEPT ![t] = [done |-> TRUE, spans |-> spans[t], truth |-> truth[t]]]
    /\ UNCHANGED <<wstate, wv, updating, held, tokens, truth, spans, boundary>>

(* HoldRequests(hold=TRUE): the batch frozen where it is; with clear_cache, restarted. *)
Hold(clear) ==
    /\ WorkerLegal(wstate, "hold_requests") /\ ~held /\ ~updating
    /\ clear => ClearCache
    /\ held' = TRUE
    /\ boundary' = [t \in Tasks |-> IF t \in running /\ ~clear THEN tokens[t] ELSE 0]
    /\ tokens' = [t \in Tasks |-> IF t \in running /\ clear THEN 0 ELSE tokens[t]]
    /\ truth' = [t \in Tasks |-> IF t \in running /\ clear THEN <<>> ELSE truth[t]]
    /\ spans' = [t \in Tasks |-> IF t \in running /\ clear THEN <<>> ELSE spans[t]]
    /\ UNCHANGED <<wstate, wv, updating, running, answered>>

(* UpdateWeights: beside a batch only when it is held (WorkInProgress.beside_batch). *)
Update ==
    /\ WorkerLegal(wstate, "update") /\ ~updating /\ wv < MaxVersion
    /\ running = {} \/ held
    /\ wstate' = WorkerNext(wstate, "update")
    /\ updating' = TRUE
    /\ UNCHANGED <<wv, held, running, tokens, truth, spans, boundary, answered>>

Updated ==
    /\ updating
    /\ wstate' = WorkerNext(wstate, "reloaded_active")
    /\ wv' = wv + 1
    /\ updating' = FALSE
    /\ UNCHANGED <<held, running, tokens, truth, spans, boundary, answered>>

(* HoldRequests(hold=FALSE): each request whose version changed opens a span at its boundary. *)
Opened(t) ==
    IF t \in running /\ (spans[t] = <<>> \/ spans[t][Len(spans[t])].v # wv) /\ Bug # "unrecorded_resume"
    THEN Append(spans[t], Span(wv, boundary[t]))
    ELSE spans[t]

Release ==
    /\ WorkerLegal(wstate, "hold_requests") /\ held /\ ~updating
    /\ held' = FALSE
    /\ spans' = [t \in Tasks |-> Opened(t)]
    /\ UNCHANGED <<wstate, wv, updating, running, tokens, truth, boundary, answered>>

Next ==
    \/ \E t \in Tasks : Submit(t) \/ Step(t) \/ Finish(t)
    \/ \E clear \in BOOLEAN : Hold(clear)
    \/ Update \/ Updated \/ Release

Spec == Init /\ [][Next]_vars

(* ------------------------------- properties ------------------------------ *)

(* The version the spans name for token i (0-based): the last span starting at or before it;
   MaxVersion + 1 (no version) where none does. *)
SpanVersion(sp, i) ==
    LET starts == {k \in 1..Len(sp) : sp[k].start <= i}
    IN IF starts = {} THEN MaxVersion + 1 ELSE sp[CHOOSE k \in starts : \A j \in starts : j <= k].v

Truthful(sp, tr) == \A i \in 1..Len(tr) : SpanVersion(sp, i - 1) = tr[i]

TypeOK ==
    /\ wstate \in WorkerStates /\ wv \in 0..MaxVersion /\ updating \in BOOLEAN /\ held \in BOOLEAN
    /\ running \subseteq Tasks /\ tokens \in [Tasks -> 0..MaxTokens]

(* A Result's spans name the version of every token it carries; so do a running request's. *)
Keep_SpansTellTheTruth ==
    /\ \A t \in Tasks : answered[t].done => Truthful(answered[t].spans, answered[t].truth)
    /\ \A t \in running : ~held => Truthful(spans[t], truth[t])
(* Beside a batch, only an update of a held one (P-7 with keep). *)
Keep_NothingBesideABatch == updating /\ running # {} => held
(* A request that runs records the version it runs under. *)
Keep_RunsOnItsLastSpan == \A t \in running : ~held => spans[t] # <<>> /\ spans[t][Len(spans[t])].v = wv
=============================================================================
