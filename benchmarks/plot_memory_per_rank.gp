# plot_memory_per_rank.gp: bytes per parameter per rank against ranks, one panel per mode
# (data-parallel, zero-1, zero-2, zero-3); the mode's ZeRO formula (bf16 replica, fp32
# gradient, K = 12: 18, 6 + 12/N, 2 + 16/N, 18/N) as a line, the library's accounting, the
# measured PSS growth (what the process holds, shared pages split between the ranks that map
# them) and the peak RSS growth as points. Called by run_memory_scaling.sh with dir, out,
# sizes and ranks set. The legend sits below the panels, off the data.
set terminal pngcairo size 1900,640 font ",11"
set output out
set multiplot layout 1,4 title "Per-rank memory / Psi: formula (line), accounting (circles), PSS growth (crosses), peak RSS growth (triangles)"
set logscale x 2
set xrange [0.8:10]
set xtics ()
do for [r in ranks] { set xtics add (r r + 0) }
set xlabel "ranks N_d"
set ylabel "bytes per parameter per rank"
set yrange [0:*]
set grid
set key outside below horizontal maxrows 3
n = words(sizes)
label(s) = sprintf("%.0fM", s / 1e6)
do for [mode in "data-parallel zero-1 zero-2 zero-3"] {
  set title mode
  f(x) = mode eq "data-parallel" ? 18 : (mode eq "zero-1" ? 6 + 12.0 / x : (mode eq "zero-2" ? 2 + 16.0 / x : 18.0 / x))
  file = dir . "/mem_" . mode . ".dat"
  plot [0.8:10] f(x) lw 2 lc "black" title "formula", \
    for [i = 1:n] file using 1:($2 == word(sizes, i) + 0 ? $3 : 1/0) with points pt 6 ps 1.6 lc i title "accounted ".label(word(sizes, i) + 0), \
    for [i = 1:n] file using 1:($2 == word(sizes, i) + 0 ? $4 : 1/0) with points pt 2 ps 1.6 lc i title "PSS ".label(word(sizes, i) + 0), \
    for [i = 1:n] file using 1:($2 == word(sizes, i) + 0 ? $5 : 1/0) with points pt 8 ps 1.2 lc i title "peak RSS ".label(word(sizes, i) + 0)
}
unset multiplot
