package privsep

// archDeniedSyscalls are the denied system calls amd64 has beside the
// generic ones (deniedSyscalls).
var archDeniedSyscalls = []string{"chown", "lchown", "mknod", "iopl", "ioperm", "uselib"}
