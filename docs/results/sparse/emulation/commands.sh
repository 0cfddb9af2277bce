TREE=/tmp/wt-exp SPARSE_K=16 ./run.sh sp-up16
TREE=/tmp/wt-exp SPARSE_K=16 SPARSE_DOWN_K=16 ./run.sh sp-up16-down16
TREE=/tmp/wt-exp SPARSE_K=8 SPARSE_DOWN_K=8 ./run.sh sp-up8-down8
TREE=/tmp/wt-exp SPARSE_K=128 SPARSE_DOWN_K=128 ./run.sh sp-dense2
TREE=/tmp/wt-exp SPARSE_K=16 SPARSE_DOWN_K=128 ./run.sh sp-up16-down2dense
TREE=/tmp/wt-exp SPARSE_K=8 ./run.sh sp-up8
TREE=/tmp/wt-exp SPARSE_K=16 SPARSE_DOWN_K=32 ./run.sh sp-up16-down32
