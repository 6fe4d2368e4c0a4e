set pagination off
handle SIGUSR1 stop nopass
handle SIGUSR2 stop nopass
run
break PyEval_SaveThread
commands 1
silent
continue
end
continue
info breakpoints
