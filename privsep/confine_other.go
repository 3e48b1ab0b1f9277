//go:build !amd64

package privsep

// archDeniedSyscalls are the denied system calls this architecture has
// beside the generic ones (deniedSyscalls): none on arm64, whose table
// holds only the generic calls.
var archDeniedSyscalls []string
