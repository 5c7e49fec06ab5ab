# plot_step_phases.gp: mean step time per phase (mean over ranks) of the largest model, for
# each mode and rank count, stacked. Called by run_memory_scaling.sh with dir, out, psi and
# cores (of the machine that ran it) set; the legend sits right of the plot, off the data.
set terminal pngcairo size 1500,520 font ",11"
set output out
set title sprintf("Step time by phase, Psi = %.0fM (%d cores: more ranks than that are oversubscribed)", psi / 1e6, cores)
set style data histograms
set style histogram rowstacked title offset 0,-0.5
set style fill solid 0.85 border -1
set boxwidth 0.8
set ylabel "seconds per step"
set yrange [0:*]
set grid ytics
set key outside right top
set bmargin 4
set xtics nomirror
plot newhistogram "data-parallel", dir."/time_data-parallel.dat" using 2:xtic(1) lc 1 title "reduce (all-reduce / reduce-scatter)", \
       "" using 3 lc 2 title "norm", "" using 4 lc 3 title "update", "" using 5 lc 4 title "all-gather", "" using 6 lc 5 title "other (zero grads)", \
     newhistogram "zero-1", dir."/time_zero-1.dat" using 2:xtic(1) lc 1 notitle, "" using 3 lc 2 notitle, "" using 4 lc 3 notitle, "" using 5 lc 4 notitle, "" using 6 lc 5 notitle, \
     newhistogram "zero-2", dir."/time_zero-2.dat" using 2:xtic(1) lc 1 notitle, "" using 3 lc 2 notitle, "" using 4 lc 3 notitle, "" using 5 lc 4 notitle, "" using 6 lc 5 notitle, \
     newhistogram "zero-3", dir."/time_zero-3.dat" using 2:xtic(1) lc 1 notitle, "" using 3 lc 2 notitle, "" using 4 lc 3 notitle, "" using 5 lc 4 notitle, "" using 6 lc 5 notitle
