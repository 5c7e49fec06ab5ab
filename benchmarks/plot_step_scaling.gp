# plot_step_scaling.gp: bench_step's phases per rank count and stage, stacked, against the
# step's memory-traffic floor (black marks). Called by run_step_scaling.sh with dat, out,
# cores and psi set; "rest" is the step minus the four phases (clearing the gradients for the
# next step, the wait for the last gathers).
set terminal pngcairo size 1400,560 font ",11"
set output out
set title sprintf("Optimizer step by phase against its floor, psi = %s, one thread per rank (%d cores: more ranks are oversubscribed)", psi, cores)
set style data histograms
set style histogram rowstacked
set style fill solid 0.85 border -1
set boxwidth 0.75
set ylabel "seconds per step (slowest rank)"
set yrange [0:*]
set grid ytics
set key outside right top
set xtics rotate by -35 nomirror
set bmargin 6
plot dat using 2:xtic(1) lc 1 title "reduce (incl. the norm's sums)", \
     "" using 3 lc 2 title "norm (its all-reduce)", \
     "" using 4 lc 3 title "update", \
     "" using 5 lc 4 title "all-gather", \
     "" using 6 lc 5 title "rest (clearing, gather wait)", \
     "" using 0:7 with points pt 7 ps 1.6 lc rgb "black" title "floor"
