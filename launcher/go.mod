module kubectl-snapshot/launcher

go 1.22
