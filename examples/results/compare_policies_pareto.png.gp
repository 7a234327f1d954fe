set terminal pngcairo size 900,600 enhanced font 'sans,11'
set output 'compare_policies_pareto.png'
set title "kvpack policies on the synthetic Llama-3.1-8B layer (32768 tokens)" noenhanced
set xlabel 'bits per element (measured: every byte memory() reports)'
set ylabel "attention-output relative error (mean)" noenhanced
set logscale y
set format y '10^{%L}'
set grid
set key top right
set offsets graph 0.05, graph 0.12, graph 0.1, graph 0.1
plot 'compare_policies_pareto.png.dat' index 1 using 2:3 with lines lw 2 lc rgb '#999999' title 'Pareto frontier', \
     'compare_policies_pareto.png.dat' index 0 using 2:3 with points pt 7 ps 1.5 lc rgb '#1f77b4' notitle, \
     'compare_policies_pareto.png.dat' index 0 using 2:3:1 with labels offset char 1,0.6 left font ',9' noenhanced notitle
