set terminal png size 800,520 noenhanced
set grid
set xlabel 'KV budget (fraction of the full cache)'
set key outside right
set xrange [0:1.05]
set output 'docs/eval/ppl_vs_budget.png'
set ylabel 'perplexity of the reference answer'
plot 'docs/eval/full.dat' using 1:2 with linespoints lw 2 title 'full', 'docs/eval/elastic.dat' using 1:2 with linespoints lw 2 title 'elastic', 'docs/eval/elastic+paper.dat' using 1:2 with linespoints lw 2 title 'elastic+paper', 'docs/eval/h2o.dat' using 1:2 with linespoints lw 2 title 'h2o', 'docs/eval/snapkv.dat' using 1:2 with linespoints lw 2 title 'snapkv', 'docs/eval/lookm.dat' using 1:2 with linespoints lw 2 title 'lookm', 'docs/eval/streaming_llm.dat' using 1:2 with linespoints lw 2 title 'streaming_llm'
set output 'docs/eval/rouge_vs_budget.png'
set ylabel 'ROUGE-L vs the Full answer'
plot 'docs/eval/full.dat' using 1:3 with linespoints lw 2 title 'full', 'docs/eval/elastic.dat' using 1:3 with linespoints lw 2 title 'elastic', 'docs/eval/elastic+paper.dat' using 1:3 with linespoints lw 2 title 'elastic+paper', 'docs/eval/h2o.dat' using 1:3 with linespoints lw 2 title 'h2o', 'docs/eval/snapkv.dat' using 1:3 with linespoints lw 2 title 'snapkv', 'docs/eval/lookm.dat' using 1:3 with linespoints lw 2 title 'lookm', 'docs/eval/streaming_llm.dat' using 1:3 with linespoints lw 2 title 'streaming_llm'
set output 'docs/eval/accuracy_vs_budget.png'
set ylabel 'exact-match accuracy (short answers)'
plot 'docs/eval/full.dat' using 1:4 with linespoints lw 2 title 'full', 'docs/eval/elastic.dat' using 1:4 with linespoints lw 2 title 'elastic', 'docs/eval/elastic+paper.dat' using 1:4 with linespoints lw 2 title 'elastic+paper', 'docs/eval/h2o.dat' using 1:4 with linespoints lw 2 title 'h2o', 'docs/eval/snapkv.dat' using 1:4 with linespoints lw 2 title 'snapkv', 'docs/eval/lookm.dat' using 1:4 with linespoints lw 2 title 'lookm', 'docs/eval/streaming_llm.dat' using 1:4 with linespoints lw 2 title 'streaming_llm'
set output 'docs/eval/rouge_ref_vs_budget.png'
set ylabel 'ROUGE-L vs the reference (long answers)'
plot 'docs/eval/full.dat' using 1:5 with linespoints lw 2 title 'full', 'docs/eval/elastic.dat' using 1:5 with linespoints lw 2 title 'elastic', 'docs/eval/elastic+paper.dat' using 1:5 with linespoints lw 2 title 'elastic+paper', 'docs/eval/h2o.dat' using 1:5 with linespoints lw 2 title 'h2o', 'docs/eval/snapkv.dat' using 1:5 with linespoints lw 2 title 'snapkv', 'docs/eval/lookm.dat' using 1:5 with linespoints lw 2 title 'lookm', 'docs/eval/streaming_llm.dat' using 1:5 with linespoints lw 2 title 'streaming_llm'
