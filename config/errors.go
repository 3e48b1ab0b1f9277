package config

import (
	"fmt"
	"strings"
)

// Error is one problem in a configuration file, at a line.
type Error struct {
	// File is the configuration file's path.
	File string
	// Line is 1-based; 0 when the problem has no single place.
	Line int
	// Key is the dotted key the problem is about, such as "mount[1].dir";
	// empty for the file as a whole.
	Key string
	// Msg says what is wrong.
	Msg string
}

// Error renders the problem as "file:line: key: message".
func (e *Error) Error() string {
	var b strings.Builder
	b.WriteString(e.File)
	if e.Line > 0 {
		fmt.Fprintf(&b, ":%d", e.Line)
	}
	b.WriteString(": ")
	if e.Key != "" {
		b.WriteString(e.Key)
		b.WriteString(": ")
	}
	b.WriteString(e.Msg)
	return b.String()
}

// ErrorList is every problem found in a configuration file, in file order.
// Load returns one when the file is invalid.
type ErrorList []*Error

// Error renders every problem, one per line.
func (l ErrorList) Error() string {
	lines := make([]string, len(l))
	for i, e := range l {
		lines[i] = e.Error()
	}
	return strings.Join(lines, "\n")
}
