package config

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"github.com/kvmount/kvmount/projector"
)

// templateLine finds the line in text/template's errors after the
// template's name: "LINE: message" or "LINE:COL: message".
var templateLine = regexp.MustCompile(`^(\d+):(?:\d+:)? (.*)$`)

// decodeTemplates decodes a mount's [[mount.templates]] entries: path,
// mode, and exactly one of file (a Go text/template file, read now — at
// start and on every reload) or text (inline). paths holds the item paths
// of the mount's projections; a template path that collides with one of
// them or with another template's is an error naming both.
func decodeTemplates(sec *Section, paths map[string]bool) []*projector.Template {
	var out []*projector.Template
	byPath := map[string]string{}
	for i, tsec := range sec.Tables("templates") {
		t := decodeTemplate(tsec)
		tsec.Done()
		if t == nil {
			continue
		}
		switch {
		case paths[t.Path]:
			tsec.Errorf("path", "%q is also the path of an item", t.Path)
		case byPath[t.Path] != "":
			tsec.Errorf("path", "%q is also the path of %s", t.Path, byPath[t.Path])
		default:
			byPath[t.Path] = fmt.Sprintf("templates[%d]", i)
			out = append(out, t)
		}
	}
	return out
}

// textStart returns the config file's line of the first line of the text
// key's value: a multi-line string ("""…) drops the newline right after its
// opening quotes (TOML), so its text starts on the next line.
func textStart(sec *Section) int {
	line := sec.Line("text")
	lines := strings.Split(sec.doc.src, "\n")
	if line > 0 && line <= len(lines) {
		if t := strings.TrimSpace(lines[line-1]); strings.HasSuffix(t, `"""`) || strings.HasSuffix(t, "'''") {
			return line + 1
		}
	}
	return line
}

// templateFileLimit is the largest template file read, in bytes.
const templateFileLimit = 1 << 20

// decodeTemplate decodes and parses one entry; nil when it has a problem
// (recorded at its line).
func decodeTemplate(sec *Section) *projector.Template {
	path := sec.String("path", "")
	mode := sec.Mode("mode", 0)
	file := sec.String("file", "")
	text := sec.String("text", "")
	switch {
	case path == "":
		sec.Errorf("", "a template needs path, where the rendered file lands in the mount")
		return nil
	case sec.Has("file") == sec.Has("text"):
		sec.Errorf("", "a template needs exactly one of file and text")
		return nil
	}
	origin := file
	if file != "" {
		data, _, err := readBounded(file, templateFileLimit)
		if err != nil {
			sec.Errorf("file", "%v", err)
			return nil
		}
		text = string(data)
	} else {
		origin = fmt.Sprintf("%s:%d", sec.doc.file, sec.Line("text"))
	}
	t, err := projector.ParseTemplate(origin, path, text, mode)
	if err != nil {
		if file == "" {
			// Report it at the config file's line of the template's line.
			rest := strings.TrimPrefix(err.Error(), "template: "+origin+":")
			if m := templateLine.FindStringSubmatch(rest); m != nil {
				n, _ := strconv.Atoi(m[1])
				sec.doc.add(textStart(sec)+n-1, sec.keyName("text"), "template: %s", m[2])
				return nil
			}
		}
		sec.Errorf(map[bool]string{true: "file", false: "text"}[file != ""], "%v", err)
		return nil
	}
	return t
}
