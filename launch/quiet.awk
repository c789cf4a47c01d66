# Used by pipe.sh on torchrun's stderr: pass everything through until torchrun starts its failure
# summary (a worker failed); hold that back. At the end, drop it if every failed worker exited with a
# status the trainer explained itself (2 bad input, 3 an explained failure, 129/130/143 stopped by a
# signal) and exit with the highest such status; the same when torchrun itself was stopped by a
# signal (Ctrl-C: its workers stop on their own and say so), or when a rank wrote a failure report for pipe.sh to
# show (-v reports=<folder of shown-by-rank*.txt>). Otherwise print it and exit 0.
# the group failed and restarted: what is held was that attempt's; start over (torchrun says so only at
# INFO level, so the restarted trainer's first line on stderr, "restart N: ...", says it too)
/will restart worker group|^\[default[0-9]+\]:restart( [0-9]+)?: / {
    for (i = 0; i < n; i++) print buf[i]
    print; fflush(); n = 0; held = 0; worst = 0; crash = 0; signalled = 0; next
}
/^\[default[0-9]+\]:/ { print; fflush(); next }   # a worker's own output always passes
# torchrun's own crash: held; a rendezvous that timed out (too few nodes came) is said in one line at the end
held == 0 && /^Traceback \(most recent call last\)/ { held = 1 }
/RendezvousTimeoutError/ { rdzv = 1 }
held == 0 && /closing signal|failed \(exitcode: / { held = 1 }
held == 0 { print; fflush(); next }
{
    buf[n++] = $0
    if (match($0, /SignalException: Process [0-9]+ got signal: [0-9]+/)) {
        sig = substr($0, RSTART, RLENGTH); sub(/.*: /, "", sig); signalled = 128 + sig
    }
    line = $0
    while (match(line, /exitcode *: *-?[0-9]+/)) {
        code = substr(line, RSTART, RLENGTH); sub(/.*: */, "", code); code += 0
        if (code == 2 || code == 3 || code == 129 || code == 130 || code == 143) { if (code > worst) worst = code }
        else if (code != -15) { crash = 1 }
        line = substr(line, RSTART + RLENGTH)
    }
}
END {
    if (rdzv) {
        split(nnodes, range, ":")
        print "pipe.sh: the nodes' rendezvous timed out: fewer than " range[1] " node(s) (NNODES=" nnodes ") " \
              "joined at " endpoint " within RDZV_TIMEOUT=" timeout " s; start the other nodes (NODE_RANK=1, 2, " \
              "...) with the same NNODES, MASTER_ADDR, MASTER_PORT and RDZV_ID, or lower NNODES' minimum"
        exit 2
    }
    # a rank not on screen reported the failure (pipe.sh shows it next): the ranks it names were stopped for it
    if (n && crash && reports != "" && system("ls '" reports "'/shown-by-rank*.txt >/dev/null 2>&1") == 0) {
        crash = 0; if (worst < 3) worst = 3
    }
    if (n && !crash && (worst || signalled)) exit (signalled > worst ? signalled : worst)
    for (i = 0; i < n; i++) print buf[i]
    exit 0
}
