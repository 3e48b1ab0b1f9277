#include "textflag.h"

// func int80(trap, a1, a2, a3 uintptr) uintptr
// A system call through the i386 entry (int $0x80) of an amd64 process:
// the number and arguments in eax, ebx, ecx and edx, the result in eax.
// A child it makes (clone, fork) exits at once with exit_group (i386 252)
// before it runs a Go instruction.
TEXT ·int80(SB),NOSPLIT,$0-40
	MOVQ trap+0(FP), AX
	MOVQ a1+8(FP), BX
	MOVQ a2+16(FP), CX
	MOVQ a3+24(FP), DX
	INT $0x80
	CMPQ AX, $0
	JNE done
	MOVQ trap+0(FP), R8
	CMPQ R8, $120 // clone
	JEQ child
	CMPQ R8, $2 // fork
	JEQ child
	JMP done
child:
	MOVQ $252, AX
	MOVQ $0, BX
	INT $0x80
done:
	MOVQ AX, ret+32(FP)
	RET
